// The sign-in form: post the key to /ui/session, which keeps it in an HttpOnly cookie.
import { request } from './api.js';

const form = document.getElementById('signin-form');
const input = document.getElementById('key');
const error = document.getElementById('err-key');

function showError(message) {
  error.textContent = message;
  input.setAttribute('aria-invalid', message ? 'true' : 'false');
  if (message) input.focus();
}

form.addEventListener('submit', async (event) => {
  event.preventDefault();
  const key = input.value.trim();
  if (!key) return showError('Enter your API key.');
  if (!key.startsWith('gpj_')) return showError('An API key starts with gpj_ (make one with gpujobs keys create).');
  const button = form.querySelector('button[type=submit]');
  button.disabled = true;
  const answer = await request('/ui/session', { method: 'POST', json: { key } });
  button.disabled = false;
  if (!answer.ok) return showError(answer.status === 401 ? 'That is not a valid API key (or it was revoked).' : answer.detail);
  showError('');
  location.assign(form.dataset.next || '/ui/');
});
input.focus();
