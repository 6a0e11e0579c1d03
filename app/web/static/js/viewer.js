// The 3D preview: a mesh (GLB, STL or OBJ) in a three.js scene that can be rotated, zoomed and
// panned with a mouse, a finger or the keyboard. three.js is vendored (static/vendor/three).
import * as THREE from '../vendor/three/three.module.min.js';
import { OrbitControls } from '../vendor/three/addons/controls/OrbitControls.js';
import { GLTFLoader } from '../vendor/three/addons/loaders/GLTFLoader.js';
import { OBJLoader } from '../vendor/three/addons/loaders/OBJLoader.js';
import { STLLoader } from '../vendor/three/addons/loaders/STLLoader.js';

const CLAY = new THREE.MeshStandardMaterial({ color: 0xc9d3e0, roughness: 0.55, metalness: 0.05 });
// Seen from the front (the image as uploaded), a little from below and the side to show depth.
const VIEW = new THREE.Vector3(0.35, -0.55, 1).normalize();
const STEP = 0.15; // radians per arrow key
const ZOOM = 0.85; // distance factor per + key

const LOADERS = {
  glb: async (url) => (await new GLTFLoader().loadAsync(url)).scene,
  obj: async (url) => new OBJLoader().loadAsync(url),
  stl: async (url) => {
    const geometry = await new STLLoader().loadAsync(url);
    geometry.computeVertexNormals();
    return new THREE.Mesh(geometry, CLAY);
  },
};

// Untextured, uncoloured meshes get a matte clay look (glTF's default material is fully metallic,
// which renders black without an environment map); coloured ones keep their colours.
function dress(object) {
  let triangles = 0;
  object.traverse((node) => {
    if (!node.isMesh) return;
    const geometry = node.geometry;
    triangles += (geometry.index ? geometry.index.count : geometry.attributes.position.count) / 3;
    const material = node.material;
    const coloured = geometry.attributes.color || (material && material.map);
    if (!coloured) node.material = CLAY;
    else if (material) material.metalness = 0;
  });
  return triangles;
}

export class MeshViewer {
  constructor(container) {
    this.container = container;
    // preserveDrawingBuffer keeps the picture in the canvas, so it can be read back (tests, screenshots).
    this.renderer = new THREE.WebGLRenderer({ antialias: true, alpha: true, preserveDrawingBuffer: true });
    this.renderer.setPixelRatio(Math.min(window.devicePixelRatio || 1, 2));
    this.renderer.setClearColor(0x000000, 0);
    const canvas = this.renderer.domElement;
    canvas.tabIndex = 0;
    canvas.setAttribute('role', 'img');
    canvas.setAttribute('aria-label', '3D preview of the mesh. Drag to rotate, scroll to zoom; with the keyboard, arrows rotate, + and − zoom, 0 resets.');
    container.append(canvas);
    this.scene = new THREE.Scene();
    this.camera = new THREE.PerspectiveCamera(35, 1, 0.01, 100000);
    this.scene.add(new THREE.HemisphereLight(0xffffff, 0x556070, 1.6));
    const key = new THREE.DirectionalLight(0xffffff, 2.2);
    key.position.set(0.5, 1, 1);
    this.camera.add(key); // the light follows the view, so the side looked at is always lit
    this.scene.add(this.camera);
    this.controls = new OrbitControls(this.camera, canvas);
    this.controls.addEventListener('change', () => this.render());
    canvas.addEventListener('keydown', (event) => this.key(event));
    new ResizeObserver(() => this.resize()).observe(container);
    this.radius = 1;
    this.object = null;
  }

  async load(url, format) {
    const load = LOADERS[format];
    if (!load) throw new Error(`no preview for .${format} files`);
    const object = await load(url);
    if (this.object) this.scene.remove(this.object);
    this.object = object;
    const triangles = dress(object);
    const box = new THREE.Box3().setFromObject(object);
    if (box.isEmpty()) throw new Error('the mesh is empty');
    object.position.sub(box.getCenter(new THREE.Vector3()));
    this.scene.add(object);
    this.radius = box.getSize(new THREE.Vector3()).length() / 2;
    this.controls.minDistance = this.radius * 0.3;
    this.controls.maxDistance = this.radius * 30;
    this.camera.near = this.radius / 100;
    this.camera.far = this.radius * 100;
    this.resize();
    this.reset();
    this.container.dataset.state = 'ready';
    this.container.dataset.triangles = String(Math.round(triangles));
  }

  reset() {
    // Far enough for the bounding sphere to fit the narrower of the two fields of view.
    const vertical = THREE.MathUtils.degToRad(this.camera.fov);
    const horizontal = 2 * Math.atan(Math.tan(vertical / 2) * this.camera.aspect);
    const distance = (this.radius / Math.sin(Math.min(vertical, horizontal) / 2)) * 1.05;
    this.controls.target.set(0, 0, 0);
    this.camera.position.copy(VIEW).multiplyScalar(distance);
    this.camera.updateProjectionMatrix();
    this.controls.update();
    this.render();
  }

  rotate(left, up) {
    const offset = this.camera.position.clone().sub(this.controls.target);
    const spherical = new THREE.Spherical().setFromVector3(offset);
    spherical.theta += left;
    spherical.phi = THREE.MathUtils.clamp(spherical.phi - up, 0.01, Math.PI - 0.01);
    this.camera.position.copy(this.controls.target).add(offset.setFromSpherical(spherical));
    this.controls.update();
  }

  zoom(factor) {
    const offset = this.camera.position.clone().sub(this.controls.target).multiplyScalar(factor);
    const length = THREE.MathUtils.clamp(offset.length(), this.controls.minDistance, this.controls.maxDistance);
    this.camera.position.copy(this.controls.target).add(offset.setLength(length));
    this.controls.update();
  }

  key(event) {
    const actions = {
      ArrowLeft: () => this.rotate(STEP, 0),
      ArrowRight: () => this.rotate(-STEP, 0),
      ArrowUp: () => this.rotate(0, STEP),
      ArrowDown: () => this.rotate(0, -STEP),
      '+': () => this.zoom(ZOOM),
      '=': () => this.zoom(ZOOM),
      '-': () => this.zoom(1 / ZOOM),
      0: () => this.reset(),
    };
    const action = actions[event.key];
    if (!action) return;
    event.preventDefault();
    action();
  }

  resize() {
    const { clientWidth: width, clientHeight: height } = this.container;
    if (!width || !height) return;
    this.renderer.setSize(width, height, false);
    this.camera.aspect = width / height;
    this.camera.updateProjectionMatrix();
    this.render();
  }

  render() {
    this.renderer.render(this.scene, this.camera);
  }
}
