// The buttons that change a job: cancel (owner) and retry (admin), wherever they are on a page.
import { flash, request, shortId } from './api.js';

const ACTIONS = {
  cancel: {
    path: (id) => `/jobs/${id}/cancel`,
    done: (id, data) => `Job ${shortId(id)} ${data.state === 'canceled' ? 'canceled' : 'is being stopped'}.`,
  },
  retry: {
    path: (id) => `/admin/jobs/${id}/retry`,
    done: (id) => `Job ${shortId(id)} queued again.`,
  },
};

// Run `action` on job `id`; resolves to the API's answer (the message is flashed).
export async function act(action, id) {
  const { path, done } = ACTIONS[action];
  const answer = await request(path(id), { method: 'POST' });
  flash(answer.ok ? done(id, answer.data) : `Job ${shortId(id)}: ${answer.detail}`, answer.ok ? 'info' : 'error');
  return answer;
}

// Clicks on [data-action][data-job] buttons; then `changed(id, action, answer)`.
export function setupActions(changed) {
  document.addEventListener('click', async (event) => {
    const button = event.target.closest('button[data-action][data-job]');
    if (!button || !(button.dataset.action in ACTIONS)) return;
    button.disabled = true;
    const answer = await act(button.dataset.action, button.dataset.job);
    if (!answer.ok) button.disabled = false;
    await changed(button.dataset.job, button.dataset.action, answer);
  });
}
