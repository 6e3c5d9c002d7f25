"""`Trainer` fine-tuning and padding-free (packed) training of GatedQwen.

Padding-free batches (`DataCollatorWithFlattening`: the sequences concatenated into one row, `position_ids`
restarting at 0 at each sequence) must give the loss and gradients of the same sequences padded into a batch: the
attention backends find the sequence boundaries from `position_ids`.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from tests.helpers import TINY as BASE
from tests.helpers import KernelLaunch, kernel_launches, sizes

TINY = sizes(BASE, vocab_size=64)
PAD = 0


def tiny_model(attn: str = "sdpa", seed: int = 0, **overrides) -> GatedQwenForCausalLM:
    torch.manual_seed(seed)
    return GatedQwenForCausalLM(GatedQwenConfig(**{**TINY, **overrides}, attn_implementation=attn))


def motif_sequences(count: int, seed: int) -> list[list[int]]:
    """Sequences of 6 to 20 tokens, each a random 3-token motif repeated (learnable by attending back)."""
    g = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(count):
        motif = torch.randint(1, TINY["vocab_size"], (3,), generator=g)
        length = int(torch.randint(6, 21, (1,), generator=g))
        sequences.append(motif.repeat(7)[:length].tolist())
    return sequences


def per_sequence_loss(model, sequences: list[list[int]]) -> float:
    """Mean next-token cross-entropy over all tokens, each sequence run through the model on its own."""
    total, count = 0.0, 0
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(ids).logits[0, :-1]
            total += F.cross_entropy(logits.double(), ids[0, 1:], reduction="sum").item()
            count += len(seq) - 1
    return total / count


def test_trainer_fine_tune_with_padding_free_batches_lowers_the_loss(tmp_path):
    sequences = motif_sequences(64, seed=0)
    train = [{"input_ids": s} for s in sequences]
    probe = sequences[:16]  # evaluated before and after: the loss on the fine-tuning data must fall
    model = tiny_model()
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=40, per_device_train_batch_size=8,
        per_device_eval_batch_size=len(probe), learning_rate=1e-2, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, report_to="none", save_strategy="no", logging_steps=10,
        use_cpu=True, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=DataCollatorWithFlattening(),
                      eval_dataset=[{"input_ids": s} for s in probe])

    before = trainer.evaluate()["eval_loss"]
    # One packed eval batch: its loss is the mean over every token of every sequence, each run on its own.
    assert before == pytest.approx(per_sequence_loss(model, probe), rel=1e-5)
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < 0.7 * before, (before, after)  # 4.21 -> 1.96 when written

    trainer.save_model(tmp_path / "final")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert per_sequence_loss(reloaded, probe) == pytest.approx(after, rel=1e-5)


def padded_batch(sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` (-100 on padding), each `[B, max_len]`."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), PAD)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss_and_gradients(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one batch and every parameter's gradient."""
    # As in stock Qwen3, a forward with `use_cache=True` (the config's default) makes a cache, and with a cache the
    # boundaries of packed sequences are not looked for; Trainer sets `config.use_cache = False` itself.
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}


# Attention backends checked for padding-free training, in float64. The Triton kernel ("gated_triton", under the
# Triton interpreter on CPU) computes in fp16/bf16/fp32 and is checked in float32 below.
PACKED_BACKENDS = ["sdpa", "eager"]


@pytest.mark.parametrize("gate", [{}, {"gate_position": "value", "gate_granularity": "headwise"}], ids=["G1", "G2h"])
@pytest.mark.parametrize("attn", PACKED_BACKENDS)
def test_padding_free_batch_gives_the_padded_loss_and_gradients(attn, gate):
    sequences = [s[:n] for s, n in zip(motif_sequences(4, seed=2), (5, 17, 3, 11))]
    packed = DataCollatorWithFlattening()([{"input_ids": s} for s in sequences])
    assert packed["input_ids"].shape == (1, sum(map(len, sequences)))

    padded_loss, padded_grads = loss_and_gradients(tiny_model(attn, **gate).double(), padded_batch(sequences))
    packed_loss, packed_grads = loss_and_gradients(tiny_model(attn, **gate).double(), packed)
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-12, atol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.parametrize("gate", [{}, {"gate_granularity": "headwise"}], ids=["G1", "G1h"])
def test_padding_free_batch_through_the_triton_kernel(gate):
    """DataCollatorWithFlattening's packed batch reaches the fused kernel's varlen path (float32, interpreter): the
    kernel runs in every layer (the backend's SDPA fallback would give the padded loss too)."""
    from gated_qwen.kernel import triton_available

    if not triton_available():
        pytest.skip("Triton is not installed, or runs neither on a GPU nor under TRITON_INTERPRET=1")
    sequences = [s[:n] for s, n in zip(motif_sequences(4, seed=3), (6, 15, 4, 9))]
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s} for s in sequences])
    padded_loss, padded_grads = loss_and_gradients(tiny_model("sdpa", **gate), padded_batch(sequences))
    with kernel_launches() as launches:
        packed_loss, packed_grads = loss_and_gradients(tiny_model("gated_triton", **gate), packed)
    gate_kind = gate.get("gate_granularity", "elementwise")
    longest = max(map(len, sequences))
    assert launches == [KernelLaunch(gate_kind, packed=True, max_queries=longest)] * TINY["num_hidden_layers"]
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
