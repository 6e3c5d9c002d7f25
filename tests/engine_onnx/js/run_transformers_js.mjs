// Runs a `gated-qwen convert --to onnx` folder with Transformers.js (@huggingface/transformers, in Node: its
// onnxruntime-node backend, CPU) and prints what it computed as JSON, for tests/engine_onnx (make test-onnx):
//
//     node run_transformers_js.mjs FOLDER '[[ids...], ...]' NEW_TOKENS
//         -> {"logits": [[flat [positions x vocab]] per prompt], "greedy": [[NEW_TOKENS ids] per prompt]}
//
// Transformers.js picks its model class and the KV cache's shape by config.json's model_type, and has no gated_qwen:
// it is given the folder's config with model_type "qwen3" (a decoder whose cache holds num_key_value_heads heads of
// head_dim, as the graph's does); the graph computes the gated model whatever the config's type. The graph is the
// folder's model.onnx (`subfolder: ""`: Transformers.js looks in onnx/ by default), float32, no network.
import fs from "node:fs";
import path from "node:path";

import { AutoModelForCausalLM, env, Tensor } from "@huggingface/transformers";

const [folder, promptsJson, newTokens] = process.argv.slice(2);
env.allowRemoteModels = false;
env.localModelPath = path.dirname(path.resolve(folder));
const config = { ...JSON.parse(fs.readFileSync(path.join(folder, "config.json"))), model_type: "qwen3" };
const model = await AutoModelForCausalLM.from_pretrained(path.basename(folder), {
  config, subfolder: "", dtype: "fp32", device: "cpu",
});
const out = { logits: [], greedy: [] };
for (const prompt of JSON.parse(promptsJson)) {
  const ids = new Tensor("int64", BigInt64Array.from(prompt.map(BigInt)), [1, prompt.length]);
  const mask = new Tensor("int64", BigInt64Array.from(prompt.map(() => 1n)), [1, prompt.length]);
  const { logits } = await model({ input_ids: ids, attention_mask: mask });
  out.logits.push(Array.from(logits.data));
  const tokens = await model.generate({
    input_ids: ids, attention_mask: mask, max_new_tokens: Number(newTokens), min_new_tokens: Number(newTokens),
    do_sample: false,
  });
  out.greedy.push(Array.from(tokens.data).slice(prompt.length).map(Number));
}
console.log(JSON.stringify(out));
