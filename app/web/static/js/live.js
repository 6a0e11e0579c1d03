// Live updates of jobs: server-sent events from /jobs/{id}/stream, and ticking wait and run times.
//
// A browser opens at most 6 HTTP/1.1 connections to one host, and every open EventSource holds
// one; so at most MAX_STREAMS jobs stream at once and the rest are polled (their fragment is
// fetched again every POLL_MS) until a stream is free. EventSource reconnects by itself after a
// network error and resumes with Last-Event-ID; a stream the server refused (401, 404) is polled.

export const FINAL = new Set(['succeeded', 'failed', 'canceled', 'quarantined']);
const ACTIVE = new Set(['queued', 'scheduled', 'running']);
const MAX_STREAMS = 4;
const POLL_MS = 4000;

export class Watcher {
  // refresh(id, data) re-renders the job and resolves to its state (null: gone);
  // progress(id, data) shows a progress event; status is an element that says whether we are live.
  constructor({ refresh, progress, status }) {
    this.refresh = refresh;
    this.progress = progress;
    this.status = status;
    this.streams = new Map();
    this.polled = new Set();
    this.busy = new Map(); // id -> {again: bool, data}: one refresh of a job at a time, in order
    setInterval(() => this.poll(), POLL_MS);
  }

  watch(id) {
    if (this.streams.has(id) || this.polled.has(id)) return;
    if (this.streams.size < MAX_STREAMS) this.open(id);
    else this.polled.add(id);
  }

  open(id) {
    const source = new EventSource(`/jobs/${id}/stream`);
    source.addEventListener('state', (event) => this.onState(id, JSON.parse(event.data)));
    source.addEventListener('progress', (event) => this.progress(id, JSON.parse(event.data)));
    source.onopen = () => {
      source.broken = false;
      this.showStatus();
    };
    source.onerror = () => {
      source.broken = true;
      if (source.readyState === EventSource.CLOSED) {
        this.streams.delete(id);
        this.polled.add(id);
      }
      this.showStatus();
    };
    this.streams.set(id, source);
    this.showStatus();
  }

  stop(id) {
    const source = this.streams.get(id);
    if (source) source.close();
    this.streams.delete(id);
    this.polled.delete(id);
    const next = this.polled.values().next();
    if (!next.done && this.streams.size < MAX_STREAMS) {
      this.polled.delete(next.value);
      this.open(next.value);
    }
    this.showStatus();
  }

  onState(id, data) {
    if (FINAL.has(data.state)) this.stop(id); // before the server closes it: no reconnect
    this.update(id, data);
  }

  async update(id, data = null) {
    const running = this.busy.get(id);
    if (running) {
      running.again = true;
      running.data = data;
      return;
    }
    const entry = { again: false, data };
    this.busy.set(id, entry);
    try {
      let state;
      do {
        entry.again = false;
        state = await this.refresh(id, entry.data);
      } while (entry.again);
      if (state === null || FINAL.has(state)) this.stop(id);
      else if (!this.streams.has(id)) this.watch(id); // e.g. retried: watch it again
    } finally {
      this.busy.delete(id);
    }
  }

  poll() {
    if (document.hidden) return;
    for (const id of [...this.polled]) this.update(id);
  }

  showStatus() {
    if (!this.status) return;
    const sources = [...this.streams.values()];
    const [text, kind] = sources.length + this.polled.size === 0 ? ['', '']
      : sources.some((s) => s.broken) ? ['Reconnecting…', ' down']
        : sources.every((s) => s.readyState === EventSource.OPEN) ? ['Live', ' on'] : ['Connecting…', ''];
    this.status.textContent = text;
    this.status.className = `live${kind}`;
  }
}

// Mirrors app/web/views.py duration().
export function duration(seconds) {
  if (seconds === null || Number.isNaN(seconds)) return '—';
  const s = Math.max(seconds, 0);
  if (s < 10) return `${s.toFixed(1)} s`;
  const whole = Math.floor(s);
  const pad = (n) => String(n).padStart(2, '0');
  if (whole < 60) return `${whole} s`;
  if (whole < 3600) return `${Math.floor(whole / 60)} min ${pad(whole % 60)} s`;
  if (whole < 86400) return `${Math.floor(whole / 3600)} h ${pad(Math.floor((whole % 3600) / 60))} min`;
  return `${Math.floor(whole / 86400)} d ${Math.floor((whole % 86400) / 3600)} h`;
}

// Mirrors app/web/views.py timings(): [wait, run] in seconds of an element's data-* times.
export function timings(el, now) {
  const at = (name) => (el.dataset[name] ? Date.parse(el.dataset[name]) : null);
  const created = at('created');
  const started = at('started');
  const finished = at('finished');
  const { state } = el.dataset;
  if (state === 'queued' || state === 'scheduled' || started === null) {
    const end = FINAL.has(state) && finished !== null ? finished : now;
    return [(end - created) / 1000, null];
  }
  const end = state === 'running' || finished === null ? now : finished;
  return [(started - created) / 1000, (end - started) / 1000];
}

// Every second, the wait and run times of unfinished jobs on the page grow.
export function startClock() {
  const serverNow = Date.parse(document.body.dataset.now);
  const offset = Number.isNaN(serverNow) ? 0 : serverNow - Date.now();
  const tick = () => {
    const now = Date.now() + offset;
    for (const el of document.querySelectorAll('[data-created][data-state]')) {
      if (!ACTIVE.has(el.dataset.state)) continue;
      const [wait, run] = timings(el, now);
      const waitCell = el.querySelector('[data-wait]');
      const runCell = el.querySelector('[data-run]');
      if (waitCell) waitCell.textContent = duration(wait);
      if (runCell) runCell.textContent = duration(run);
    }
  };
  setInterval(tick, 1000);
}

// A progress event shown in an element holding a <progress>, a .pct and a .msg.
export function showProgress(el, data) {
  if (!el) return;
  const bar = el.querySelector('progress');
  const pct = el.querySelector('.pct');
  const msg = el.querySelector('.msg');
  const value = Math.max(0, Math.min(1, Number(data.progress) || 0));
  if (bar) bar.value = value;
  if (pct) pct.textContent = `${Math.round(value * 100)}%`;
  if (msg && data.message !== undefined) msg.textContent = data.message || '';
}
