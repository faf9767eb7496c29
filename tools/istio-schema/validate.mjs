// Validates Istio resources (YAML files, several documents each) offline against the OpenAPI
// schemas of Istio's CRDs, as shipped by the @kubernetes-models/istio package (generated from
// Istio's crd-all.gen.yaml; versions pinned in package-lock.json).
//
// Why: tollgate ships Istio manifests (envoy/istio/) that no cluster checks in CI. The CRD
// schema catches wrong types, bad enum values (phase, failStrategy), bad patterns (sha256).
// The CRD schemas allow unknown fields (an API server prunes them silently, so a typo'd field
// would vanish), so every key is also checked against the field names the schema declares for
// that kind — a name-only check that catches typos, skipping free-form maps (pluginConfig,
// labels, annotations, matchLabels, an EnvoyFilter patch's value).
//
// Usage: node validate.mjs [--modules DIR] FILE...   (DIR: where node_modules is; default:
// next to this script, then <repo>/.venv/node/node_modules). Non-Istio documents (core
// kinds) are reported as skipped. Exit 0 when every Istio document is valid, 1 otherwise.
import { existsSync, readFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
let modules = null;
if (args[0] === "--modules") {
  modules = resolve(args[1]);
  args.splice(0, 2);
}
modules ??= [join(here, "node_modules"), join(here, "..", "..", ".venv", "node", "node_modules")].find(
  (d) => existsSync(join(d, "@kubernetes-models", "istio")),
);
if (!modules) {
  console.error("validate.mjs: @kubernetes-models/istio is not installed: run tools/setup");
  process.exit(2);
}
const pkg = join(modules, "@kubernetes-models", "istio");
const YAML = await import(pathToFileURL(join(modules, "yaml", "dist", "index.js")).href);

const FREE_FORM = new Set(["pluginConfig", "labels", "annotations", "matchLabels"]);
// Free-form by path: an EnvoyFilter patch's `value` is Envoy configuration (a protobuf
// Struct), which the Istio schema does not describe.
const FREE_FORM_PATHS = [/\.configPatches\[\d+\]\.patch\.value$/];
const fieldNames = new Map();

function declaredFields(group, version, kind) {
  const key = `${group}/${version}/${kind}`;
  if (!fieldNames.has(key)) {
    const dts = readFileSync(join(pkg, group, version, `${kind}.d.ts`), "utf8");
    fieldNames.set(key, new Set([...dts.matchAll(/"([A-Za-z0-9_$]+)"\??:/g)].map((m) => m[1])));
  }
  return fieldNames.get(key);
}

function unknownKeys(value, known, path, out) {
  if (Array.isArray(value)) {
    value.forEach((v, i) => unknownKeys(v, known, `${path}[${i}]`, out));
  } else if (value !== null && typeof value === "object") {
    for (const [k, v] of Object.entries(value)) {
      if (!known.has(k)) out.push(`${path}.${k}`);
      else if (!FREE_FORM.has(k) && !FREE_FORM_PATHS.some((p) => p.test(`${path}.${k}`)))
        unknownKeys(v, known, `${path}.${k}`, out);
    }
  }
}

let failures = 0;
let checked = 0;
for (const file of args) {
  const docs = YAML.parseAllDocuments(readFileSync(file, "utf8"));
  for (const doc of docs) {
    if (doc.errors.length) {
      console.log(`ERROR ${file}: YAML: ${doc.errors.map((e) => e.message).join("; ")}`);
      failures++;
      continue;
    }
    const obj = doc.toJS();
    if (obj === null || obj === undefined) continue;
    const [group, version] = String(obj.apiVersion ?? "").split("/");
    const what = `${file}: ${obj.kind}/${obj.metadata?.name}`;
    if (!group.endsWith(".istio.io") || !version) {
      console.log(`SKIP  ${what} (${obj.apiVersion} is not an Istio API)`);
      continue;
    }
    let Model;
    try {
      Model = (await import(pathToFileURL(join(pkg, group, version, "index.js")).href))[obj.kind];
    } catch {
      Model = undefined;
    }
    if (!Model) {
      console.log(`ERROR ${what}: no schema for ${obj.apiVersion} ${obj.kind}`);
      failures++;
      continue;
    }
    checked++;
    try {
      new Model(obj).validate();
    } catch (e) {
      console.log(`ERROR ${what}: ${e.message}`);
      failures++;
      continue;
    }
    const unknown = [];
    unknownKeys(obj.spec ?? {}, declaredFields(group, version, obj.kind), "spec", unknown);
    if (unknown.length) {
      console.log(`ERROR ${what}: fields the ${obj.kind} schema does not define: ${unknown.join(", ")}`);
      failures++;
      continue;
    }
    console.log(`OK    ${what} (${obj.apiVersion})`);
  }
}
console.log(`${checked} Istio resource(s) checked, ${failures} invalid`);
process.exit(failures ? 1 : 0);
