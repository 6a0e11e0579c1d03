// The jobs page: the list keeps itself current (live.js), new jobs from the form appear at the
// top and are followed at once, and cancel buttons work in place.
import { flash, fragment, shortId } from './api.js';
import { setupActions } from './actions.js';
import { FINAL, Watcher, showProgress, startClock } from './live.js';
import { setupSubmit } from './submit.js';

const body = document.getElementById('jobs-body');

// Fetch the job's row again and put it in place; resolves to its state (null: gone).
async function refreshRow(id) {
  const answer = await fragment(`/ui/jobs/${id}/row`);
  if (!answer.ok) return answer.status === 404 ? null : document.getElementById(`job-${id}`)?.dataset.state ?? null;
  const [row] = answer.nodes;
  const old = document.getElementById(row.id);
  if (old) old.replaceWith(row);
  return row.dataset.state;
}

const watcher = new Watcher({
  refresh: async (id, data) => {
    const row = document.getElementById(`job-${id}`);
    if (data && row && row.dataset.state === data.state && !FINAL.has(data.state)) return data.state;
    return refreshRow(id);
  },
  progress: (id, data) => showProgress(document.getElementById(`job-${id}`), data),
  status: document.getElementById('live-status'),
});

// Whether a new job belongs on the list as it is filtered now.
function shows(job) {
  const { state, model, firstPage } = body.dataset;
  return firstPage === 'true' && (!state || state === job.state) && (!model || model === job.model);
}

async function submitted(job) {
  if (!shows(job)) {
    flash(`Job ${shortId(job.id)} queued; the filters hide it.`);
    return;
  }
  const answer = await fragment(`/ui/jobs/${job.id}/row`);
  if (!answer.ok) return;
  const [row] = answer.nodes;
  if (!document.getElementById(row.id)) {
    body.querySelector('tr.empty')?.remove();
    row.classList.add('new');
    body.prepend(row);
  }
  watcher.watch(job.id);
}

for (const row of body.querySelectorAll('tr.job-row')) {
  if (!FINAL.has(row.dataset.state)) watcher.watch(row.dataset.job);
}
startClock();
setupActions((id) => watcher.update(id));
setupSubmit(submitted);

// On a phone, a list with jobs opens with the form folded away (the summary unfolds it).
const panel = document.getElementById('submit-panel');
if (panel && matchMedia('(max-width: 720px)').matches && body.querySelector('tr.job-row')) panel.open = false;
