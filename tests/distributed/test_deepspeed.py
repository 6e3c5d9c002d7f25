"""DeepSpeed ZeRO-2 and ZeRO-3 through `accelerate launch --config_file examples/accelerate/deepspeed_zero{2,3}.yaml`
(the commands of docs/training.md), on 2 CPU processes with gloo (`DS_ACCELERATOR=cpu`, `ddp_backend="gloo"`),
against one process with the same data: per-step loss and gradient norm, final weights, and the saved model
reloaded with `from_pretrained` (tolerances: tests/accelerate_runs.py). Needs DeepSpeed: `make test-distributed`
(.venv-distributed; `make test` does not collect this folder).

ZeRO-3 with `zero3_init_flag: true` partitions the parameters at load (`from_pretrained` under `zero.Init`: each
rank holds a part of each, the module's tensors are empty placeholders); its weights come back two ways, gathered
by Accelerate when `Trainer.save_model` saves (`zero3_save_16bit_model: true`) and from the checkpoint's partitions
with the `zero_to_fp32.py` the checkpoint carries.
"""

import sys

import pytest
import torch

from tests.accelerate_runs import (
    MODELS,
    STEPS,
    assert_same_model,
    assert_steps_match,
    build,
    largest_step_difference,
    launch,
    reference,
    run_command,
    run_facts,
    with_config,
)

pytestmark = pytest.mark.slow  # every check here starts several processes


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("deepspeed")
    build(work)
    reference(work)
    launch(work, "deepspeed_zero2", "zero2")
    launch(work, "deepspeed_zero3", "zero3")
    return work


def assert_deepspeed(run: dict, stage: int) -> None:
    assert len(run["ranks"]) == 2
    for facts in run["ranks"]:
        assert facts["distributed_type"] == "DEEPSPEED" and facts["num_processes"] == 2, facts
        assert facts["wrapped_class"] == "deepspeed.runtime.engine.DeepSpeedEngine", facts
        assert facts["zero_stage"] == stage, facts


@pytest.mark.parametrize("name", MODELS)
def test_zero2_matches_one_process(work, name):
    run, one = run_facts(work / "zero2" / name), run_facts(work / "one" / name)
    assert_deepspeed(run, 2)
    assert [loaded["partitioned_at_load"] for loaded in run["loaded"]] == [None, None]  # whole on each rank
    assert_steps_match(run, one)
    measured = assert_same_model(work / "zero2" / name / "final", work / "one" / name / "final",
                                 work / "models" / name, torch.load(work / "data.pt"))
    print(f"zero2 {name}: steps {largest_step_difference(run, one):.1e} (relative), {measured}")


@pytest.mark.parametrize("name", MODELS)
def test_zero3_partitions_at_load_and_matches_one_process(work, name):
    run, one = run_facts(work / "zero3" / name), run_facts(work / "one" / name)
    assert_deepspeed(run, 3)
    assert [loaded["partitioned_at_load"] for loaded in run["loaded"]] == [True, True]
    assert_steps_match(run, one)
    data = torch.load(work / "data.pt")
    gathered = assert_same_model(work / "zero3" / name / "final", work / "one" / name / "final",
                                 work / "models" / name, data)
    checkpoint = work / "zero3" / name / "trainer" / f"checkpoint-{STEPS}"
    assert sorted(p.name for p in (checkpoint / f"global_step{STEPS}").glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    consolidated = work / "zero3" / name / "zero_to_fp32"
    # (not --safe_serialization: with tied embeddings it keeps both names on one tensor, which safetensors refuses)
    run_command([sys.executable, str(checkpoint / "zero_to_fp32.py"), str(checkpoint), str(consolidated)], {},
                work / f"zero_to_fp32-{name}.log")
    assert (consolidated / "pytorch_model.bin").is_file()
    measured = assert_same_model(with_config(consolidated, checkpoint), work / "one" / name / "final",
                                 work / "models" / name, data)
    print(f"zero3 {name}: steps {largest_step_difference(run, one):.1e} (relative), gathered {gathered}, "
          f"zero_to_fp32 {measured}")
