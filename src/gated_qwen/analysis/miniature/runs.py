"""The runs of `gated-qwen reproduce`: each model trained with the Transformers `Trainer` on a built-in corpus
(`corpora`), one per family, variant, learning rate and seed (`presets`), and measured on held-out documents
(`measure.analyze`: F-Attn per layer and head, M-Act, at the first token too, |SDPA output| before and after the
gate, gate scores; F-Attn split by query token and position), with its perplexity beyond the training length with
and without YaRN (and recall, on a recall corpus), its perplexity under fake quantization (`quantize`), its held-out
loss against the corpus's entropy where that is known, and the stability of its training loss.

`run_all` trains every run of a plan once (runs two families share are trained once), in worker processes
(`workers`) when asked.
"""

from __future__ import annotations

import io
import math
import os
import platform
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from ... import GatedQwenForCausalLM
from ...files import scratch_folder
from ...model.gating import gate_parameters_per_layer, gated_layers
from ..measure import analyze, first_token_attention_per_query
from ..perplexity import mean_nll, perplexity_by_length, yarn_bands
from ..plots import moving_average
from ..quantize import SCHEMES, perplexity_under_quantization
from .corpora import HELDOUT_SEED
from .presets import Plan, Preset, extrapolation_lengths, model_config, planned_runs, training_key
from .workers import SCRATCH, run_in_workers

SPIKE_WINDOW = 10  # training losses are averaged over this many steps before looking for spikes
SEQUENCE_PARTS = 4  # F-Attn is also reported per quarter of the query positions ("throughout the sequence")


def loss_spikes(losses: list[float], window: int = SPIKE_WINDOW) -> dict:
    """How unstable a training loss curve is: `max_rise`, the largest rise (nats) of its `window`-step moving
    average above the lowest value that average had reached before, and `diverged` (a non-finite loss)."""
    if not all(math.isfinite(x) for x in losses):
        return {"max_rise": math.inf, "diverged": True}
    smooth = moving_average(losses, window)
    best, rise = math.inf, 0.0
    for value in smooth:
        rise = max(rise, value - best)
        best = min(best, value)
    return {"max_rise": rise, "diverged": False}


def sink_profile(per_query: torch.Tensor, triggers: torch.Tensor | None) -> dict:
    """Where the attention sink sits. `per_query: [N, layers, heads, S]`, the attention on the first token of every
    query (`measure.first_token_attention_per_query`); `triggers: [N, S]` bool, the query tokens that are triggers
    (None for a corpus without them). Query 0 (which sees only itself) is left out everywhere. Returns
    `by_part`: F-Attn (mean over layers and heads) over each of `SEQUENCE_PARTS` consecutive, nearly equal parts of
    the query positions 1..S-1; and with `triggers`: `trigger` / `other`, F-Attn over the trigger queries / all the
    other queries, `other_per_layer_head` (`[layers][heads]`) and `trigger_share`."""
    p0 = per_query[..., 1:].double()
    mean = p0.mean(dim=(1, 2))  # [N, S-1]
    profile = {"by_part": [part.mean().item() for part in mean.tensor_split(SEQUENCE_PARTS, dim=1)]}
    if triggers is not None:
        is_trigger = triggers[:, 1:]
        profile.update(
            trigger=mean[is_trigger].mean().item() if is_trigger.any() else None,
            other=mean[~is_trigger].mean().item() if (~is_trigger).any() else None,
            other_per_layer_head=p0.movedim(0, 2)[..., ~is_trigger].mean(-1).tolist(),
            trigger_share=is_trigger.double().mean().item(),
        )
    return profile


class _Documents(torch.utils.data.Dataset):
    """`ids: [N, S]` as causal-LM examples (the model shifts the labels)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def held_out(preset: Preset, length: int | None = None) -> torch.Tensor:
    """The held-out documents of `length` tokens (default `seq_len * max(extrapolation)`):
    `[max(eval_documents, extrapolation_documents), length]`; training documents use other seeds. For the
    Bigram-Backcopy and `repeats` corpora a shorter length gives the first tokens of the same documents; a
    `KeyValueRecall` document is drawn for its length (its queries fill its second half)."""
    count = max(preset.eval_documents, preset.extrapolation_documents)
    return preset.language.sample(count, length or preset.seq_len * max(preset.extrapolation), seed=HELDOUT_SEED)


def train_and_measure(preset: Preset, variant: str, learning_rate: float, seed: int,
                      threads: int | None = None) -> tuple[dict, torch.nn.Module]:
    """Trains one model with the `Trainer` and measures it. Returns a JSON-ready dict (the attention maps and
    F-Attn by position as tensors under `"tensors"`) and the trained model. Writes nothing but a scratch folder of
    its own (the caller saves the model: a worker process never writes into the output)."""
    if threads:
        torch.set_num_threads(threads)
    with _quiet_transformers():
        return _train_and_measure_quietly(preset, variant, learning_rate, seed)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Transformers' warnings and progress bars off (save_pretrained would draw one per model), restored after."""
    verbosity, bars = transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _train(model, preset: Preset, learning_rate: float, seed: int, seq_len: int, steps: int) -> list[dict]:
    """`steps` steps of the `Trainer` on `preset.language` documents of `seq_len` tokens drawn with `seed` (AdamW,
    cosine schedule with warmup); returns the log entries of the steps (`loss`, `grad_norm`)."""
    train = preset.language.sample(steps * preset.batch_size, seq_len, seed=seed)
    with scratch_folder("trainer") as scratch:
        SCRATCH.add(scratch)
        args = TrainingArguments(
            output_dir=scratch, max_steps=steps, per_device_train_batch_size=preset.batch_size,
            learning_rate=learning_rate, lr_scheduler_type="cosine",
            warmup_steps=round(preset.warmup_fraction * steps), weight_decay=preset.weight_decay,
            adam_beta2=0.95, max_grad_norm=preset.max_grad_norm or 0.0, bf16=preset.bf16, logging_steps=1,
            save_strategy="no", report_to="none",
            disable_tqdm=True, use_cpu=not torch.cuda.is_available(), seed=seed, dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=_Documents(train))
        trainer.remove_callback(PrinterCallback)
        try:
            trainer.train()
        finally:
            SCRATCH.discard(scratch)
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _train_and_measure_quietly(preset: Preset, variant: str, learning_rate: float,
                               seed: int) -> tuple[dict, torch.nn.Module]:
    started = time.perf_counter()
    heldout = held_out(preset, preset.seq_len)
    torch.manual_seed(seed)
    model = GatedQwenForCausalLM(model_config(preset, variant))
    model.set_attn_implementation("sdpa")
    history = []
    for seq_len, steps in (*preset.short_stages, (preset.seq_len, preset.steps)):
        history += _train(model, preset, learning_rate, seed, seq_len, steps)
    losses = [float(entry["loss"]) for entry in history]
    trained = time.perf_counter()

    model.eval()
    eval_ids = heldout[: preset.eval_documents, : preset.seq_len]
    result = {
        "variant": variant,
        "learning_rate": learning_rate,
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "gate_parameters": gate_parameters_per_layer(model.config) * len(gated_layers(model.config)),
        "train_loss": losses,
        "grad_norm": [float(entry.get("grad_norm", math.nan)) for entry in history],
        "final_train_loss": sum(losses[-SPIKE_WINDOW:]) / len(losses[-SPIKE_WINDOW:]),
        "heldout_loss": mean_nll(model, eval_ids),
        **{f"loss_{k}": v for k, v in loss_spikes(losses).items()},
    }
    result["heldout_ppl"] = math.exp(result["heldout_loss"]) if math.isfinite(result["heldout_loss"]) else math.inf
    floor = getattr(preset.language, "entropy_floor", None)
    result["entropy_floor"] = floor(preset.seq_len) if floor else None
    result["quantization"] = perplexity_under_quantization(model, eval_ids, list(SCHEMES))
    analysed = heldout[: preset.analysis_documents, : preset.seq_len]
    analysis = analyze(model, analysed, batch_size=preset.analysis_documents)
    result["analysis"] = {"summary": analysis["summary"], "layers": analysis["layers"],
                          "gate_histogram_edges": analysis["gate_histogram_edges"]}
    is_trigger = getattr(preset.language, "is_trigger", None)
    result["sink"] = sink_profile(first_token_attention_per_query(model, analysed, batch_size=preset.analysis_documents),
                                  is_trigger(analysed) if is_trigger else None)
    factor = max(preset.extrapolation)
    result["extrapolation"] = perplexity_by_length(
        model, lambda length: held_out(preset, length)[: preset.extrapolation_documents],
        extrapolation_lengths(preset), yarn_factor=factor if factor > 1 else None,
        batch_size=preset.extrapolation_documents, recall_targets=getattr(preset.language, "recall_targets", None))
    if factor > 1:
        result["yarn_bands"] = yarn_bands(model.config, factor)
    result["seconds"] = {"train": trained - started, "measure": time.perf_counter() - trained}
    result["tensors"] = {"attention_maps": analysis["attention_maps"],
                         "first_token_attention_by_position": analysis["first_token_attention_by_position"]}
    return result, model


def _train_in_worker(numbered: tuple[int, dict]) -> tuple[int, dict, object, bytes]:  # picklable entry point
    """(index, result, config, tensors) of one run, its tensors (the model's state dict, the result's `"tensors"`)
    as the bytes of `torch.save`, read back by `_tensors_from_worker`: a trained model holds hooks that do not pickle,
    and tensors pickled as they are travel through a socket file in TMPDIR, which a long TMPDIR makes too long a path
    for a Unix socket (108 bytes)."""
    index, run = numbered
    result, model = train_and_measure(**run)
    packed = io.BytesIO()
    torch.save({"state": model.state_dict(), "tensors": result.pop("tensors")}, packed)
    return index, result, model.config, packed.getvalue()


def _tensors_from_worker(result: dict, config, tensors: bytes) -> tuple[dict, torch.nn.Module]:
    """The result and model of one run that `_train_in_worker` handed back."""
    packed = torch.load(io.BytesIO(tensors), weights_only=True)
    model = GatedQwenForCausalLM(config)
    model.load_state_dict(packed["state"])
    return {**result, "tensors": packed["tensors"]}, model


def unique_runs(plan: Plan) -> list[tuple[Preset, str, float, int]]:
    """`(preset, variant, learning rate, seed)` of every model `plan` trains, each once, in the order of its
    families' `planned_runs` (a run two families share, the same `training_key`, comes at its first family)."""
    seen, runs = set(), []
    for family in plan.families:
        for variant, learning_rate, seed in planned_runs(family.preset, family.variants):
            key = (training_key(family.preset), variant, learning_rate, seed)
            if key not in seen:
                seen.add(key)
                runs.append((family.preset, variant, learning_rate, seed))
    return runs


def family_runs(plan: Plan, results: dict) -> dict[str, dict[tuple[str, float, int], dict]]:
    """Each family's runs, `{(variant, learning rate, seed): result}`, from `results`
    (`{(training_key, variant, learning rate, seed): result}`, what `run_all` returns)."""
    return {family.name: {(v, lr, seed): results[(training_key(family.preset), v, lr, seed)]
                          for v, lr, seed in planned_runs(family.preset, family.variants)}
            for family in plan.families}


def model_folder(plan: Plan, preset: Preset) -> str:
    """The prefix of a run's model folder: "" for the main models, "<family>-" for another family's."""
    name = next(f.name for f in plan.families if training_key(f.preset) == training_key(preset))
    return "" if name == "main" else f"{name}-"


def run_all(plan: Plan, models_dir: Path | None, jobs: int, progress: bool = True) -> dict:
    """Trains every run of `unique_runs(plan)` and returns `{(training_key, variant, learning rate, seed):
    result}` in that order; each model saved into `models_dir` (if given) by this process, as `<prefix><run name>`
    (`model_folder`). With `jobs` > 1, that many runs at a time in spawned worker processes (CPU threads shared out
    among them), which needs the calling script's code under `if __name__ == "__main__":` as usual for
    multiprocessing. The workers write nothing (they hand back results and models) and end with this process: on an
    error or Ctrl-C here they are terminated (they ignore Ctrl-C themselves, so they print nothing), and a worker
    whose parent was killed exits within 0.2 s."""
    planned = unique_runs(plan)
    runs = [dict(preset=preset, variant=variant, learning_rate=lr, seed=seed) for preset, variant, lr, seed in planned]
    save_to = [models_dir / f"{model_folder(plan, preset)}{run_name(variant, lr, seed)}" if models_dir else None
               for preset, variant, lr, seed in planned]
    results: dict = {}

    def finished(index: int, result: dict, model) -> None:
        preset, variant, lr, seed = planned[index]
        results[(training_key(preset), variant, lr, seed)] = result
        if save_to[index] is not None:
            with _quiet_transformers():
                model.save_pretrained(save_to[index])

    with tqdm(total=len(runs), desc="reproduce", unit="run", disable=not progress) as bar:
        if jobs <= 1:
            for index, run in enumerate(runs):
                bar.set_postfix_str(run_name(run["variant"], run["learning_rate"], run["seed"]))
                finished(index, *train_and_measure(**run))
                bar.update(1)
        else:
            threads = max(1, (os.cpu_count() or 1) // jobs)
            numbered = [(index, {**run, "threads": threads}) for index, run in enumerate(runs)]
            with closing(run_in_workers(_train_in_worker, numbered, jobs)) as handed_back:
                for index, *result in handed_back:
                    finished(index, *_tensors_from_worker(*result))
                    bar.update(1)
    return {key: results[key] for key in ((training_key(p), v, lr, seed) for p, v, lr, seed in planned)}


def run_name(variant: str, learning_rate: float, seed: int) -> str:
    return f"{variant}-lr{learning_rate:g}-seed{seed}"


def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """What the numbers were measured on."""
    return {
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
        "processor": cpu_name(), "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "transformers": __import__("transformers").__version__,
    }
