// Validate Strimzi resources with the validators generated from the real Strimzi CRDs
// (npm @kubernetes-models/strimzi-kafka-operator). Not part of pytest (it needs node and an
// npm install); see tests/deploy/schemas/README.md for how to run it.
// Usage: node strimzi-crd-check.mjs resources.json   (a JSON array of resources)
import fs from "node:fs";
const docs = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
let bad = 0;
for (const d of docs) {
  const ver = d.apiVersion.split("/")[1];
  const mod = await import(`@kubernetes-models/strimzi-kafka-operator/kafka.strimzi.io/${ver}/${d.kind}`);
  const Cls = mod[d.kind];
  try { new Cls(d).validate(); console.log("ok", d.kind, d.metadata.name); }
  catch (e) { bad++; console.log("FAIL", d.kind, d.metadata.name, e.message); }
}
process.exit(bad ? 1 : 0);
