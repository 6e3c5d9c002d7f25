"""DDP and FSDP2 through `accelerate launch --config_file examples/accelerate/{ddp,fsdp2}.yaml` (the commands of
docs/training.md), on 2 CPU processes with gloo, against one process with the same data: per-step loss and
gradient norm, final weights, and the saved checkpoint reloaded with `from_pretrained` (tolerances:
tests/accelerate_runs.py). DeepSpeed ZeRO-2/3 are in tests/distributed/ (`make test-distributed`, which runs this
file too).

The FSDP2 run must really be sharded: every decoder layer and the root are FSDP2 units and the gate's parameters
are DTensor shards (dim 0, half on each rank). Accelerate 1.15 never applies FSDP without a GPU (the run stays DDP, and
its losses agree all the same); tests/dist_scripts/fsdp_on_cpu.py lifts that for these runs, and the last test
shows that without the lift the sharding check fails while a loss-only comparison would pass.
"""

import pytest
import torch

from tests.accelerate_runs import (
    ACCELERATE,
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
    work = tmp_path_factory.mktemp("accelerate")
    build(work)
    reference(work)
    launch(work, "ddp", "ddp")
    launch(work, "fsdp2", "fsdp2")
    launch(work, "fsdp2", "fsdp2-unlifted", ("G1-elementwise",), "--no-fsdp-cpu-lift")
    return work


def assert_fsdp2_sharded(run: dict) -> None:
    """Every rank: Accelerate's type FSDP, every decoder layer and the root an FSDP2 unit, every parameter a DTensor,
    the gate's sharded on dim 0 with half of the rows here."""
    assert len(run["ranks"]) == 2
    for rank, facts in enumerate(run["ranks"]):
        assert facts["distributed_type"] == "FSDP", (rank, facts)
        fsdp = facts["fsdp"]
        assert fsdp["root_wrapped"] and fsdp["layers_wrapped"] and all(fsdp["layers_wrapped"]), (rank, fsdp)
        assert fsdp["all_parameters_dtensor"], (rank, fsdp)
        assert fsdp["gate"], (rank, fsdp)
        for name, gate in fsdp["gate"].items():
            assert gate["dtensor"] and gate["shard0"], (rank, name, gate)
            assert gate["local_shape"] == [-(-gate["global_shape"][0] // 2), *gate["global_shape"][1:]], (rank, gate)


@pytest.mark.parametrize("name", MODELS)
def test_ddp_matches_one_process(work, name):
    run, one = run_facts(work / "ddp" / name), run_facts(work / "one" / name)
    for facts in run["ranks"]:
        assert facts["distributed_type"] == "MULTI_CPU" and facts["num_processes"] == 2, facts
        assert facts["wrapped_class"] == "torch.nn.parallel.distributed.DistributedDataParallel", facts
    assert_steps_match(run, one)
    measured = assert_same_model(work / "ddp" / name / "final", work / "one" / name / "final",
                                 work / "models" / name, torch.load(work / "data.pt"))
    print(f"ddp {name}: steps {largest_step_difference(run, one):.1e} (relative), {measured}")


@pytest.mark.parametrize("name", MODELS)
def test_fsdp2_is_sharded_and_matches_one_process(work, name):
    """The sharded state of the checkpoint (`SHARDED_STATE_DICT`, as fsdp2.yaml asks), merged as Accelerate's docs
    say (`accelerate merge-weights`) and given the model's config.json, reloads with the one process's weights."""
    run, one = run_facts(work / "fsdp2" / name), run_facts(work / "one" / name)
    assert_fsdp2_sharded(run)
    assert_steps_match(run, one)
    sharded = work / "fsdp2" / name / "trainer" / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in sharded.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one per rank
    merged = work / "fsdp2" / name / "merged"
    run_command([str(ACCELERATE), "merge-weights", str(sharded), str(merged)], {}, work / f"merge-{name}.log")
    measured = assert_same_model(with_config(merged, work / "models" / name), work / "one" / name / "final",
                                 work / "models" / name, torch.load(work / "data.pt"))
    print(f"fsdp2 {name}: steps {largest_step_difference(run, one):.1e} (relative), {measured}")


def test_fsdp2_check_fails_when_the_sharding_is_skipped(work):
    """The same launch without the CPU lift: Accelerate silently trains with DDP. Its losses still agree with one
    process (a loss-only comparison passes), and the sharding check fails on the distributed type."""
    run, one = run_facts(work / "fsdp2-unlifted" / "G1-elementwise"), run_facts(work / "one" / "G1-elementwise")
    assert_steps_match(run, one)
    assert [facts["distributed_type"] for facts in run["ranks"]] == ["MULTI_CPU", "MULTI_CPU"]
    with pytest.raises(AssertionError, match="'distributed_type': 'MULTI_CPU'"):
        assert_fsdp2_sharded(run)
