// The admin page: its sections are fetched again every few seconds (the failed jobs only while
// none is selected), and failed jobs are retried one at a time, by selection, or all at once.
import { flash, fragment, request, swap } from './api.js';
import { act, setupActions } from './actions.js';

const REFRESH_MS = 5000;
const status = document.getElementById('live-status');
const $ = (id) => document.getElementById(id);

function selected() {
  return [...document.querySelectorAll('#admin-failed .select-job:checked')].map((box) => box.value);
}

async function refresh({ failed = false } = {}) {
  const answer = await fragment('/ui/admin/live');
  if (!answer.ok) {
    status.textContent = answer.status ? `Refresh failed (${answer.status})` : 'Reconnecting…';
    status.className = 'live down';
    return;
  }
  const keepFailed = !failed && (selected().length > 0 || $('admin-failed')?.contains(document.activeElement));
  swap(answer.nodes.filter((node) => !(keepFailed && node.id === 'admin-failed')));
  status.textContent = `Updated ${new Date().toLocaleTimeString()}`;
  status.className = 'live on';
  updateBulk();
}

function updateBulk() {
  const button = $('retry-selected');
  if (!button) return;
  const count = selected().length;
  button.disabled = count === 0;
  button.textContent = count ? `Retry ${count} selected` : 'Retry selected';
}

document.addEventListener('change', (event) => {
  if (event.target.id === 'select-all') {
    for (const box of document.querySelectorAll('#admin-failed .select-job')) box.checked = event.target.checked;
  }
  if (event.target.closest('#admin-failed')) updateBulk();
});

// What a bulk retry did, and what it left: it stops at the queue limit, and passes over jobs that
// another request holds, so the admin knows to retry again; it never queues jobs of a model the
// API's registry lacks (no worker of it would run them), and counts them apart.
function retried({ retried: done, left, unserved = 0, queue_full: full }) {
  if (!left && !unserved) return `${done} jobs queued again.`;
  const said = [];
  if (left) {
    const why = full ? 'the queue is full (GPUJOBS_QUEUE_LIMIT). Retry again once it has room.'
      : 'another request held them. Retry again.';
    said.push(`${left} left: ${why}`);
  }
  if (unserved) said.push(`${unserved} not: their model is not in the API's model registry. Add it back to retry them.`);
  return `${done} jobs queued again; ${said.join(' ')}`;
}

document.addEventListener('click', async (event) => {
  const target = event.target.closest('button');
  if (!target) return;
  if (target.id === 'retry-selected') {
    target.disabled = true;
    const ids = selected();
    const answers = await Promise.all(ids.map((id) => act('retry', id)));
    const done = answers.filter((a) => a.ok).length;
    flash(`${done} of ${ids.length} jobs queued again.`, done === ids.length ? 'info' : 'error');
    await refresh({ failed: true });
  } else if (target.id === 'retry-all') {
    const model = $('retry-model').value;
    const which = model ? `every failed ${model} job` : 'every failed job';
    if (!window.confirm(`Queue ${which} again?`)) return;
    target.disabled = true;
    const answer = await request('/admin/jobs/retry', { method: 'POST', json: model ? { model } : {} });
    const whole = answer.ok && !answer.data.left && !answer.data.unserved;
    flash(answer.ok ? retried(answer.data) : answer.detail, whole ? 'info' : 'error');
    await refresh({ failed: true });
  }
});

setupActions(() => refresh({ failed: true }));
setInterval(() => { if (!document.hidden) refresh(); }, REFRESH_MS);
