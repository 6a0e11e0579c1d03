// Requests from the page to this service. The HttpOnly session cookie authenticates them; the
// X-Requested-With header marks them as the page's own (the server refuses a cookie-authenticated
// change without it, which is what stops other sites from forging requests: docs/ui.md).

export const HEADERS = { 'X-Requested-With': 'gpujobs' };

// Over 500 characters the server would not return to it anyway (security.MAX_NEXT_CHARS).
export function signIn() {
  const next = location.pathname + location.search;
  location.assign(next.length > 500 ? '/ui/sign-in' : '/ui/sign-in?next=' + encodeURIComponent(next));
}

function detailOf(data, response) {
  if (data && typeof data === 'object' && 'detail' in data) {
    const detail = data.detail;
    if (typeof detail === 'string') return detail;
    if (Array.isArray(detail)) {
      return detail.map((e) => `${(e.loc || []).filter((p) => p !== 'body').join('.')}: ${e.msg}`).join('; ');
    }
  }
  return `${response.status} ${response.statusText}`.trim();
}

// fetch() with the page's header; resolves to {ok, status, data, detail, headers}, never throws.
export async function request(path, { method = 'GET', json, body, headers = {} } = {}) {
  const init = { method, headers: { ...HEADERS, ...headers }, credentials: 'same-origin' };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers['Content-Type'] = 'application/json';
  } else if (body !== undefined) {
    init.body = body;
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch {
    return { ok: false, status: 0, data: null, headers: new Headers(),
      detail: 'The service cannot be reached; check the connection and try again.' };
  }
  if (response.status === 401 && !path.startsWith('/ui/session')) signIn();
  const type = response.headers.get('content-type') || '';
  const data = type.includes('json')
    ? await response.json().catch(() => null)
    : await response.text().catch(() => '');
  const ok = response.ok;
  return { ok, status: response.status, data, headers: response.headers, detail: ok ? '' : detailOf(data, response) };
}

// A server-rendered fragment: its top-level elements, each with the id of what it replaces.
export async function fragment(path) {
  const answer = await request(path);
  if (!answer.ok) return { ...answer, nodes: [] };
  const template = document.createElement('template');
  template.innerHTML = answer.data;
  return { ...answer, nodes: [...template.content.children] };
}

// Put each element in the place of the element with its id; returns those that found one.
export function swap(nodes) {
  return nodes.filter((node) => {
    const old = node.id ? document.getElementById(node.id) : null;
    if (old) old.replaceWith(node);
    return Boolean(old);
  });
}

let flashTimer = 0;

// A short message at the top of the page, read out by screen readers.
export function flash(message, kind = 'info') {
  const box = document.getElementById('flash');
  if (!box) return;
  box.textContent = message;
  box.className = `flash show ${kind}`;
  clearTimeout(flashTimer);
  flashTimer = setTimeout(() => { box.className = 'flash'; }, kind === 'error' ? 12000 : 6000);
}

export const shortId = (id) => String(id).slice(0, 8);

const signOut = document.getElementById('sign-out');
if (signOut) {
  signOut.addEventListener('click', async () => {
    signOut.disabled = true;
    await request('/ui/session', { method: 'DELETE' });
    location.assign('/ui/sign-in');
  });
}
