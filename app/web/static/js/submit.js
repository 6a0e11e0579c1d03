// The form for a new job: an image (dropped or chosen), a model, its parameters built from the
// model's schema (GET /models), a priority. Checks mirror the server's; the server's own errors
// are shown next to the field they name ("params.resolution: must be at most 1024").
import { flash, request, shortId } from './api.js';
import { checkImage, formatSize } from './images.js';

const $ = (id) => document.getElementById(id);

function newIdempotencyKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16)); // randomUUID needs a secure context
  return Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

// "params.width_mm: must be at most 1000" -> ["params.width_mm", "Must be at most 1000"]
function split(message) {
  const match = /^([A-Za-z_][A-Za-z0-9_.]*): (.*)$/s.exec(message);
  const [field, text] = match ? [match[1], match[2]] : [null, message];
  return [field, text.charAt(0).toUpperCase() + text.slice(1)];
}

function inputOf(field) {
  return field && field.startsWith('params.') ? $(`param-${field.slice(7)}`) : $(field);
}

export function clearErrors(form) {
  for (const box of form.querySelectorAll('.error')) box.textContent = '';
  for (const input of form.querySelectorAll('[aria-invalid]')) input.removeAttribute('aria-invalid');
}

// Show `message` next to the field it names (or `field`), else above the submit button.
export function showError(message, field = null) {
  const [named, text] = split(message);
  const target = field || named;
  const box = (target && $(`err-${target}`)) || $('err-form');
  box.textContent = box.id === 'err-form' ? message : text;
  const input = inputOf(target);
  if (input && box.id !== 'err-form') input.setAttribute('aria-invalid', 'true');
  return input || box;
}

function label(text, forId) {
  const el = document.createElement('label');
  el.htmlFor = forId;
  el.textContent = text;
  return el;
}

function paragraph(className, id, text = '') {
  const p = document.createElement('p');
  p.className = className;
  p.id = id;
  p.textContent = text;
  return p;
}

function hintFor(spec) {
  const parts = [spec.description || ''];
  if (spec.min !== null || spec.max !== null) parts.push(`${spec.min ?? '…'} to ${spec.max ?? '…'}`);
  if (spec.default !== null && spec.type !== 'bool') parts.push(`default ${spec.default}`);
  if (spec.required) parts.push('required');
  return parts.filter(Boolean).join(' · ');
}

function controlFor(name, spec) {
  const id = `param-${name}`;
  if (spec.choices) {
    const select = document.createElement('select');
    for (const choice of spec.choices) {
      const option = new Option(String(choice), String(choice), false, choice === spec.default);
      select.append(option);
    }
    select.id = id;
    return select;
  }
  const input = document.createElement('input');
  input.id = id;
  if (spec.type === 'bool') {
    input.type = 'checkbox';
    input.checked = Boolean(spec.default);
    return input;
  }
  if (spec.type === 'int' || spec.type === 'float') {
    input.type = 'number';
    input.step = spec.type === 'int' ? '1' : 'any';
    input.inputMode = spec.type === 'int' ? 'numeric' : 'decimal';
    if (spec.min !== null) input.min = String(spec.min);
    if (spec.max !== null) input.max = String(spec.max);
  } else {
    input.type = 'text';
    input.maxLength = 4096;
    input.spellcheck = false;
  }
  input.value = spec.default === null ? '' : String(spec.default);
  input.required = spec.required;
  return input;
}

function fieldFor(name, spec) {
  const field = document.createElement('div');
  field.className = spec.type === 'bool' ? 'field check' : 'field';
  field.dataset.field = `params.${name}`;
  const control = controlFor(name, spec);
  control.name = name;
  control.dataset.type = spec.type;
  control.setAttribute('aria-describedby', `hint-${name} err-params.${name}`);
  const text = name.replace(/_/g, ' ');
  if (spec.type === 'bool') field.append(control, label(text, control.id));
  else field.append(label(text, control.id), control);
  field.append(paragraph('hint', `hint-${name}`, hintFor(spec)), paragraph('error', `err-params.${name}`));
  return field;
}

// The parameters' values as the API wants them; problems are shown and make it return null.
function collectParams(model) {
  const params = {};
  let ok = true;
  for (const [name, spec] of Object.entries(model.params || {})) {
    const input = $(`param-${name}`);
    const fail = (problem) => { showError(`params.${name}: ${problem}`); ok = false; };
    if (spec.type === 'bool') { params[name] = input.checked; continue; }
    const raw = input.value.trim();
    if (raw === '') { if (spec.required) fail('a value is required'); continue; }
    if (spec.type === 'str') {
      if (raw.startsWith('-')) fail("must not start with '-'");
      params[name] = raw;
      continue;
    }
    const value = Number(raw);
    if (input.validity.badInput || !Number.isFinite(value)) fail('must be a number');
    else if (spec.type === 'int' && !Number.isInteger(value)) fail('must be an integer');
    else if (spec.min !== null && value < spec.min) fail(`must be at least ${spec.min}`);
    else if (spec.max !== null && value > spec.max) fail(`must be at most ${spec.max}`);
    params[name] = value;
  }
  return ok ? params : null;
}

function checkPriority(input) {
  const value = Number(input.value);
  const [min, max] = [Number(input.min), Number(input.max)];
  if (input.value.trim() === '' || !Number.isInteger(value) || value < min || value > max) {
    showError(`priority: must be a whole number between ${min} and ${max}`);
    return null;
  }
  return value;
}

export function setupSubmit(onSubmitted) {
  const form = $('submit-form');
  if (!form) return;
  const limits = { maxBytes: Number(form.dataset.maxBytes), maxPixels: Number(form.dataset.maxPixels) };
  const models = {};
  let file = null;
  // One key per request: a resubmission of the same image, model, priority and params (an answer
  // lost on the way) reuses it and gets the same job back; any change takes a new one, which the
  // server would otherwise refuse (409) as a key reused for another request.
  let idempotencyKey = null;
  let keyFor = null;
  const imageInput = $('image');
  const zone = $('dropzone');
  const preview = $('image-preview');

  function renderParams() {
    const box = $('params');
    for (const child of [...box.children]) if (child.tagName !== 'LEGEND') child.remove();
    const model = models[$('model').value];
    const unserved = model && model.live_workers === 0
      ? ' No live worker serves this model now: its jobs wait until one starts.' : '';
    $('model-hint').textContent = model ? (model.description || '') + unserved : '';
    if (!model) return;
    const entries = Object.entries(model.params || {});
    if (!entries.length) box.append(paragraph('hint', 'params-status', 'This model takes no parameters.'));
    const grid = document.createElement('div');
    grid.className = 'params-grid';
    for (const [name, spec] of entries) grid.append(fieldFor(name, spec));
    box.append(grid);
  }

  async function choose(chosen) {
    $('err-image').textContent = '';
    imageInput.removeAttribute('aria-invalid');
    file = null;
    preview.hidden = true;
    if (preview.src) URL.revokeObjectURL(preview.src);
    preview.removeAttribute('src');
    $('image-name').textContent = '';
    zone.classList.remove('has-file');
    if (!chosen) return;
    const problem = await checkImage(chosen, limits);
    if (problem) { showError(problem, 'image'); return; }
    file = chosen;
    $('image-name').textContent = `${chosen.name} · ${formatSize(chosen.size)}`;
    preview.src = URL.createObjectURL(chosen);
    preview.hidden = false;
    zone.classList.add('has-file');
  }

  imageInput.addEventListener('change', () => choose(imageInput.files[0]));
  for (const type of ['dragenter', 'dragover']) {
    zone.addEventListener(type, (e) => { e.preventDefault(); zone.classList.add('over'); });
  }
  for (const type of ['dragleave', 'drop']) {
    zone.addEventListener(type, (e) => { e.preventDefault(); zone.classList.remove('over'); });
  }
  zone.addEventListener('drop', (e) => choose(e.dataTransfer.files[0]));
  // A file dropped next to the zone must not make the browser leave the page to show it.
  for (const type of ['dragover', 'drop']) window.addEventListener(type, (e) => e.preventDefault());
  $('model').addEventListener('change', renderParams);

  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    clearErrors(form);
    const model = models[$('model').value];
    const params = model ? collectParams(model) : null;
    const priority = checkPriority($('priority'));
    if (!file) showError('image: choose or drop an image first', 'image');
    if (!model) showError('model: choose a model');
    const invalid = form.querySelector('[aria-invalid="true"]');
    if (invalid || !file || params === null || priority === null) {
      (invalid || imageInput).focus();
      return;
    }
    const body = new FormData();
    body.append('image', file, file.name);
    body.append('model', model.name);
    body.append('priority', String(priority));
    body.append('params', JSON.stringify(params));
    const asked = JSON.stringify([file.name, file.size, file.lastModified, model.name, priority, params]);
    if (asked !== keyFor) [idempotencyKey, keyFor] = [newIdempotencyKey(), asked];
    const button = $('submit-button');
    button.disabled = true;
    $('submit-status').textContent = 'Uploading…';
    const answer = await request('/jobs', { method: 'POST', body, headers: { 'Idempotency-Key': idempotencyKey } });
    button.disabled = false;
    $('submit-status').textContent = '';
    if (!answer.ok) {
      const field = answer.status === 413 || answer.status === 415 ? 'image' : null;
      const retry = answer.headers.get('retry-after');
      const message = answer.status === 429 && retry ? `${answer.detail} (try again in ${retry} s)` : answer.detail;
      showError(message, field).focus();
      return;
    }
    keyFor = null;  // the next submission is a new request, even of the same image
    imageInput.value = '';
    await choose(null);
    $('submit-status').textContent = `Job ${shortId(answer.data.id)} queued.`;
    await onSubmitted(answer.data);
  });

  request('/models').then((answer) => {
    if (!answer.ok) {
      $('params-status').textContent = `The models could not be loaded: ${answer.detail}`;
      return;
    }
    for (const model of answer.data.models) models[model.name] = model;
    renderParams();
  }).catch(() => flash('The models could not be loaded.', 'error'));
}
