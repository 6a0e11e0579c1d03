// A job's page: status, downloads, history and log follow the job live; the 3D preview loads
// (three.js, only then) once the job has a mesh.
import { fragment, swap } from './api.js';
import { setupActions } from './actions.js';
import { FINAL, Watcher, showProgress, startClock } from './live.js';

const page = document.getElementById('job-page');
const id = page.dataset.job;
let viewer = null;
let shown = ''; // the mesh on screen: its link and attempt (a retried job's new mesh has the same name)

async function showMesh() {
  const status = document.getElementById('job-status');
  const url = status?.dataset.meshUrl;
  const which = `${url}#${status?.dataset.meshAttempt}`;
  const empty = document.getElementById('viewer-empty');
  if (!url && !shown && FINAL.has(status?.dataset.state)) {
    // it ended with nothing to draw: the page as served says so (job.html), and so must this one
    empty.textContent = status.dataset.expired ? "Retention deleted this job's files." : 'This job has no mesh to show.';
  }
  if (!url || which === shown) return;
  shown = which;
  const container = document.getElementById('viewer');
  empty.textContent = 'Loading the preview…';
  try {
    if (!viewer) {
      const { MeshViewer } = await import('./viewer.js');
      viewer = new MeshViewer(container);
      const reset = document.getElementById('viewer-reset');
      reset.addEventListener('click', () => viewer.reset());
      reset.hidden = false;
    }
    await viewer.load(url, status.dataset.meshFormat);
    empty.hidden = true;
  } catch (error) {
    empty.hidden = false;
    empty.textContent = `The preview could not be shown: ${error.message || error}. The files can still be downloaded.`;
    container.dataset.state = 'error';
  }
}

async function refresh() {
  const answer = await fragment(`/ui/jobs/${id}/live`);
  if (!answer.ok) return answer.status === 404 ? null : document.getElementById('job-status').dataset.state;
  swap(answer.nodes);
  showMesh();
  return document.getElementById('job-status').dataset.state;
}

const watcher = new Watcher({
  refresh,
  progress: (_, data) => showProgress(document.getElementById('job-status'), data),
  status: null,
});

if (!FINAL.has(document.getElementById('job-status').dataset.state)) {
  watcher.watch(id);
}
startClock();
setupActions(() => watcher.update(id));
showMesh();
