"""``Muon`` in transformers' ``Trainer``: tiny random Qwen3-MoE and Llama models train with
param groups from ``muon_param_groups``, a cosine schedule and gradient clipping; the loss
falls, and a run resumed from a Trainer checkpoint (weights, optimizer state, scheduler, RNG)
ends bitwise where the uninterrupted run ends."""

import shutil

import pytest
import torch

from muon_offload import Muon, muon_param_groups

NEEDS_HF = 'needs transformers: pip install -e ".[hf]"'
transformers = pytest.importorskip("transformers", reason=NEEDS_HF)
pytest.importorskip("accelerate", reason=NEEDS_HF)  # Trainer's own dependency

CUDA = torch.cuda.is_available()
VOCAB, SEQ, ROWS, STEPS = 61, 12, 24, 6


def _config(arch):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=SEQ,
    )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    return transformers.LlamaConfig(**common, tie_word_embeddings=True)


class _Sequences(torch.utils.data.Dataset):
    """Rows that step through the vocabulary by 7 from a random start: learnable in a few
    steps (random tokens would leave the loss at log(VOCAB))."""

    def __init__(self):
        start = torch.randint(VOCAB, (ROWS, 1), generator=torch.Generator().manual_seed(3))
        self.rows = (start + 7 * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return dict(input_ids=self.rows[i], labels=self.rows[i])


@pytest.fixture
def deterministic():
    """On a GPU, index_add_ (the MoE's token scatter) is deterministic only when asked."""
    before = torch.are_deterministic_algorithms_enabled()
    if CUDA:
        torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before)


def _train(out, arch, *, offload, resume=None):
    torch.manual_seed(0)
    if resume is None:
        model = transformers.AutoModelForCausalLM.from_config(
            _config(arch), attn_implementation="eager"
        )
    else:
        # Trainer's resume loads model.safetensors as a plain state dict, but save_pretrained
        # wrote the MoE experts per expert (transformers 5.24): the 3-D expert stacks would
        # stay as initialized. from_pretrained converts them back.
        model = transformers.AutoModelForCausalLM.from_pretrained(
            resume, attn_implementation="eager"
        )
    model.to("cuda" if CUDA else "cpu")
    opt = Muon(muon_param_groups(model, lr=0.02, adamw_lr=3e-3), offload=offload)
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=STEPS // 2,
        report_to="none",
        use_cpu=not CUDA,
        seed=0,
        disable_tqdm=True,
        log_level="error",
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Sequences(), optimizers=(opt, None)
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, opt, losses


def _params(model):
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


# The MoE with offload where a GPU exists (off on CPUs); the dense model always offloaded
# (on CPUs, offload=True runs the same chunked pipeline through host memory).
@pytest.mark.parametrize("arch, offload", [("qwen3_moe", CUDA), ("llama", True)])
def test_trainer_trains_and_resumes_bitwise(arch, offload, tmp_path, deterministic):
    model, opt, losses = _train(tmp_path / "full", arch, offload=offload)
    assert len(losses) == STEPS
    # Measured: 4.11 -> 3.71 (MoE) and 4.18 -> 3.83 (Llama) over 6 steps on the CPU.
    assert losses[-1] < losses[0] - 0.15, losses
    assert {"muon", "adamw"} <= {g["algorithm"] for g in opt.param_groups}
    full = _params(model)
    checkpoint = tmp_path / "full" / f"checkpoint-{STEPS // 2}"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert {"momentum", "variance"} <= {k for s in saved["state"].values() for k in s}

    resumed_model, _, resumed_losses = _train(
        tmp_path / "resumed", arch, offload=offload, resume=checkpoint
    )
    assert resumed_losses[-(STEPS // 2) :] == losses[-(STEPS // 2) :]
    resumed = _params(resumed_model)
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name

    # The check sees the optimizer state: the same resume without optimizer.pt (fresh
    # momentum and variance) ends elsewhere.
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / "optimizer.pt").unlink()
    bare_model, _, _ = _train(tmp_path / "bare_run", arch, offload=offload, resume=bare)
    assert not all(torch.equal(p.detach().cpu(), full[n]) for n, p in bare_model.named_parameters())
