"""dpzero.hf.PrivateTrainer: a Trainer run takes make_private's steps on the same model,
batches and optimizer (σ = 0); its ε is the accountant's for (q, σ, steps); evaluation costs no
privacy; a checkpoint resumes with every released step counted once; bad settings are refused,
naming the value. References: make_private driven by hand with an independent per-example loss
(a loop over examples), and dpzero's accountant fed (q, σ, steps) directly."""

from __future__ import annotations

import gc
import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

import dpzero
from dpzero import _C
import ranks

transformers = pytest.importorskip("transformers")
from dpzero.hf import PrivacyArguments, PrivateTrainer  # noqa: E402

N, T, VOCAB = 48, 8, 40


def gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=1,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def bert(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=T, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def gpt2_lora(seed=0):
    """GPT-2 with LoRA adapters on its attention and MLP input projections (B non-zero, so A's
    gradient is too): only the adapters train."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(gpt2(seed), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0,
        fan_in_fan_out=True))
    torch.manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    return model


def lm_data(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (T,), generator=g)
        labels = ids.clone()
        labels[int(torch.randint(2, T, (1,), generator=g)):] = -100  # ragged: per-example counts
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def cls_data(n=N, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (T,), generator=g),
             "labels": int(torch.randint(0, 3, (1,), generator=g))} for _ in range(n)]


def example_loss(kind, model, batch):
    """Reference per-example losses, example by example from the micro-batch's logits (Note
    [trainer loss]): a causal LM's mean over the example's own labelled next tokens, a
    classifier's cross-entropy."""
    all_logits = model(input_ids=batch["input_ids"]).logits
    out = []
    for i in range(batch["input_ids"].shape[0]):
        logits = all_logits[i]
        y = batch["labels"][i]
        if kind.startswith("gpt2"):
            out.append(F.cross_entropy(logits[:-1], y[1:], ignore_index=-100, reduction="sum")
                       / (y[1:] != -100).sum().clamp(min=1))
        else:
            out.append(F.cross_entropy(logits.view(1, -1), y.view(1)))
    return torch.stack(out)


def trainer_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                gradient_accumulation_steps=2, learning_rate=0.05, optim="sgd",
                lr_scheduler_type="constant", logging_steps=1, report_to=[],
                save_strategy="no", use_cpu=True, seed=3, disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _trained_by_hand(kind, model, data, c, steps, autocast=None):
    """``model``'s weights after ``steps`` σ = 0 steps of make_private driven by hand, as the
    Trainer of trainer_args drives it (same seed, so the same Poisson batches and micro-batches);
    ``autocast``: the dtype the forward and loss run under, or None."""
    p = dpzero.make_private(
        model, data_loader=DataLoader(data, batch_size=8,
                                      collate_fn=transformers.default_data_collator),
        noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=c, max_physical_batch_size=4,
        seed=3, loss_reduction="sum", optimizer="sgd", lr=0.05)
    taken = 0
    while taken < steps:
        for batch in p.data_loader:
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = example_loss(kind, p.model, batch).sum()
            loss.backward()
            if p.optimizer.step():
                taken += 1
            p.optimizer.zero_grad()
            if taken == steps:
                break
    return {n: q.detach() for n, q in model.named_parameters()}


@pytest.mark.parametrize("kind", ["gpt2", "bert", "gpt2-lora"])
@pytest.mark.parametrize("c", [0.5, 1e4])
def test_trainer_steps_equal_make_private(tmp_path, kind, c):
    # σ = 0: the Trainer's run and make_private driven by hand (same seed, so the same Poisson
    # batches and micro-batches) reach the same weights. C = 0.5 clips every example; C = 1e4
    # clips none, so each example's gradient enters at its own scale (a loss normalised over the
    # whole micro-batch would show here, Note [trainer loss]).
    make, data = {"gpt2": (gpt2, lm_data()), "bert": (bert, cls_data()),
                  "gpt2-lora": (gpt2_lora, lm_data())}[kind]
    steps = 3
    trainer = PrivateTrainer(
        model=make(), args=trainer_args(tmp_path, max_steps=steps), train_dataset=data,
        privacy_args=PrivacyArguments(noise_multiplier=0.0, allow_no_noise=True,
                                      max_grad_norm=c, seed=3))
    trainer.train()
    got = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    want = _trained_by_hand(kind, make(), data, c, steps)
    assert got.keys() == want.keys()
    init = make()
    moved = {}
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
        moved[n] = float((want[n] - init.get_parameter(n).detach()).abs().max())
    assert max(moved.values()) > 1e-4  # the steps changed the weights (not two inits compared)
    if kind == "gpt2-lora":  # only the adapters moved
        assert {n for n, v in moved.items() if v > 0} == {n for n in moved if "lora_" in n}


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_bf16_trains_and_evaluates_under_autocast(tmp_path, kind):
    # bf16=True: at σ = 0 the Trainer's weights equal make_private driven by hand under
    # torch.autocast(bf16) (that path is checked against per-example autograd in test_amp), and
    # differ from the float32 run's by far more than the tolerance, so a Trainer that ignored
    # bf16 fails here. C = 1e4 clips no example: each bf16 gradient enters at its own scale.
    make, data = {"gpt2": (gpt2, lm_data()), "bert": (bert, cls_data())}[kind]
    steps, c = 2, 1e4
    trainer = PrivateTrainer(
        model=make(), args=trainer_args(tmp_path, max_steps=steps, bf16=True),
        train_dataset=data, privacy_args=PrivacyArguments(
            noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=c, seed=3))
    layer = trainer.model.get_submodule(
        "transformer.h.0.mlp.c_fc" if kind == "gpt2" else "bert.encoder.layer.0.output.dense")
    seen = []
    layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    trainer.train()
    assert seen and set(seen) == {torch.bfloat16}
    got = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert all(p.dtype == torch.float32 for p in got.values())  # float32 masters stay

    want = _trained_by_hand(kind, make(), data, c, steps, autocast=torch.bfloat16)
    fp32 = _trained_by_hand(kind, make(), data, c, steps)
    far = 0.0
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)
        far = max(far, float((got[n] - fp32[n]).abs().max()))
    assert far > 1e-5, far

    # Evaluation runs under the same autocast: its loss is a plain bf16 Trainer's on a copy of
    # the trained weights (accelerate's autocast), bit for bit, and not the float32 one.
    seen.clear()
    held_out = lm_data(8, seed=5) if kind == "gpt2" else cls_data(8, seed=5)
    loss = trainer.evaluate(held_out)["eval_loss"]
    assert set(seen) == {torch.bfloat16}
    plain = {}
    for bf16 in (True, False):
        model = make()
        model.load_state_dict(trainer.model.state_dict())
        plain[bf16] = transformers.Trainer(
            model=model, args=transformers.TrainingArguments(
                output_dir=str(tmp_path / f"plain{bf16}"), bf16=bf16, use_cpu=True, report_to=[],
                disable_tqdm=True)).evaluate(held_out)["eval_loss"]
    assert loss == plain[True] != plain[False]  # the same operations: the same bits


def test_lora_at_zero_stage_3_steps_as_at_stage_0(tmp_path):
    # PeftModel calls its base model directly, past the LoRA tuner's forward: the engine's units
    # look through the tuner, so stage 3 gathers what the adapters' forwards read. Reference: the
    # stage-0 run (itself checked against make_private by hand above), with a checkpoint saved
    # mid-run at stage 3 (a gather of the sharded adapters).
    runs = {}
    for stage in (0, 3):
        out = tmp_path / f"stage{stage}"
        trainer = PrivateTrainer(
            model=gpt2_lora(), train_dataset=lm_data(),
            args=trainer_args(out, max_steps=3, save_strategy="steps", save_steps=2),
            privacy_args=PrivacyArguments(noise_multiplier=0.0, allow_no_noise=True,
                                          max_grad_norm=0.5, seed=3, zero_stage=stage))
        trainer.train()
        runs[stage] = {n: p.detach().clone() for n, p in trainer.private_model.state_dict().items()
                       if "lora_" in n}
        assert os.path.exists(out / "out" / "checkpoint-2" / "adapter_model.safetensors")
    assert runs[0].keys() == runs[3].keys() and len(runs[0]) == 4
    init = {n: p for n, p in gpt2_lora().state_dict().items() if "lora_" in n}
    for n in runs[0]:
        torch.testing.assert_close(runs[3][n], runs[0][n], rtol=1e-5, atol=1e-6, msg=n)
    assert max(float((runs[0][n] - init[n]).abs().max())
               for n in runs[0]) > 1e-4


@pytest.mark.parametrize("stage", [0, 3])
def test_a_tied_weight_is_saved_once_at_every_stage(tmp_path, stage):
    # GPT-2 ties lm_head.weight to the token embedding. Reference: the plain model's own
    # save_pretrained, which writes the tied tensor once; the private model's file must hold the
    # same keys (at stage 3 the gathered state dict once held two copies) and the trained values.
    from safetensors.torch import load_file

    trainer = PrivateTrainer(
        model=gpt2(), args=trainer_args(tmp_path, max_steps=2), train_dataset=lm_data(),
        privacy_args=PrivacyArguments(noise_multiplier=0.0, allow_no_noise=True,
                                      max_grad_norm=0.5, seed=3, zero_stage=stage))
    trainer.train()
    sd = trainer.model.state_dict()
    # One storage under two names, as in the plain model's state dict.
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    trainer.save_model(str(tmp_path / "saved"))
    got = load_file(str(tmp_path / "saved" / "model.safetensors"))
    gpt2().save_pretrained(str(tmp_path / "plain"))
    want = load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert got.keys() == want.keys() and "lm_head.weight" not in got
    torch.testing.assert_close(got["transformer.wte.weight"], sd["transformer.wte.weight"])
    assert not torch.equal(got["transformer.wte.weight"], want["transformer.wte.weight"])


def test_weight_decay_exempts_what_the_trainer_exempts(tmp_path):
    # AdamW with weight_decay: the Trainer's split (biases and LayerNorm weights undecayed) must
    # reach the private step. Reference: make_private with torch's two groups, split by name.
    steps = 3
    trainer = PrivateTrainer(
        model=gpt2(), args=trainer_args(tmp_path, max_steps=steps, optim="adamw_torch",
                                        weight_decay=0.1, learning_rate=0.05),
        train_dataset=lm_data(),
        privacy_args=PrivacyArguments(noise_multiplier=0.0, allow_no_noise=True,
                                      max_grad_norm=0.5, seed=3))
    trainer.train()
    got = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    model = gpt2()
    named = list(model.named_parameters())
    exempt = [q for n, q in named if n.endswith(".bias") or ".ln_" in n]
    assert len(exempt) > 4
    groups = [{"params": [q for n, q in named if not (n.endswith(".bias") or ".ln_" in n)],
               "weight_decay": 0.1}, {"params": exempt, "weight_decay": 0.0}]
    p = dpzero.make_private(
        model, data_loader=DataLoader(lm_data(), batch_size=8,
                                      collate_fn=transformers.default_data_collator),
        noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=0.5, max_physical_batch_size=4,
        seed=3, loss_reduction="sum", optimizer=torch.optim.AdamW(groups, lr=0.05))
    taken = 0
    while taken < steps:
        for batch in p.data_loader:
            example_loss("gpt2", p.model, batch).sum().backward()
            if p.optimizer.step():
                taken += 1
            p.optimizer.zero_grad()
            if taken == steps:
                break
    for n, q in model.named_parameters():
        torch.testing.assert_close(got[n], q.detach(), rtol=1e-5, atol=1e-6, msg=n)
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.1


def test_epsilon_is_the_accountants_and_evaluation_is_free(tmp_path):
    data = lm_data()
    trainer = PrivateTrainer(
        model=gpt2(), args=trainer_args(tmp_path, num_train_epochs=1), train_dataset=data,
        eval_dataset=data[:8], privacy_args=PrivacyArguments(target_epsilon=2.0))
    q = 8 / N
    steps = int(1 / q)  # one epoch
    assert trainer.planned_steps == steps and trainer.sample_rate == pytest.approx(q)
    trainer.train()
    delta = min(1e-5, 1 / (10 * N))
    acc = dpzero.PRVAccountant()
    acc.step(noise_multiplier=trainer.noise_multiplier, sample_rate=q, num_steps=steps)
    want = float(acc.get_epsilon(delta))
    assert want <= 2.0 + 1e-9
    logged = [h for h in trainer.state.log_history if "epsilon" in h]
    assert logged[-1]["epsilon"] == pytest.approx(want, rel=1e-9)
    assert logged[-1]["delta"] == delta
    assert [h["epsilon"] for h in logged] == sorted(h["epsilon"] for h in logged)
    # Evaluation: a loss, and nothing charged.
    charges = trainer.privacy_engine.charges
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    assert trainer.privacy_engine.charges == charges == steps
    assert trainer.epsilon() == pytest.approx(want, rel=1e-9)
    # The report dpzero report makes, from the ledger in output_dir.
    with open(os.path.join(trainer.args.output_dir, "report.json")) as f:
        report = json.load(f)
    assert report["steps"] == steps and report["delta"] == delta


def _tensorboard_scalars(log_dir):
    """{tag: [(step, value)]} from the TensorBoard event files under log_dir, read record by
    record (TFRecord framing: length, its CRC, the Event proto, its CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    out = {}
    for root, _, files in os.walk(log_dir):
        for name in files:
            if not name.startswith("events.out.tfevents"):
                continue
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            at = 0
            while at < len(data):
                (length,) = struct.unpack("<Q", data[at:at + 8])
                event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
                at += 16 + length
                for value in event.summary.value:
                    out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_epsilon_reaches_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX")  # requirements.txt installs it
    args = trainer_args(tmp_path, max_steps=4, logging_steps=2, report_to=["tensorboard"])
    trainer = PrivateTrainer(model=gpt2(), train_dataset=lm_data(), args=args,
                             privacy_args=PrivacyArguments(noise_multiplier=1.0))
    trainer.train()
    scalars = _tensorboard_scalars(args.output_dir)  # the Trainer's default: output_dir/runs/
    # Every training log carries ε: steps 2 and 4, and the summary at the end.
    logged = [(h["step"], h["epsilon"]) for h in trainer.state.log_history if "epsilon" in h]
    assert [step for step, _ in logged] == [2, 4, 4]
    assert [step for step, _ in scalars["train/epsilon"]] == [2, 4, 4]
    for (_, got), (_, want) in zip(scalars["train/epsilon"], logged):
        assert got == pytest.approx(want, rel=1e-6)  # TensorBoard keeps float32
    assert scalars["train/delta"][0][1] == pytest.approx(trainer.delta, rel=1e-6)


def test_checkpoint_resume_counts_every_step_once(tmp_path):
    data = lm_data()
    args = trainer_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    privacy = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0)
    first = PrivateTrainer(model=gpt2(), args=args, train_dataset=data, privacy_args=privacy)
    first.train()
    ckpt = os.path.join(args.output_dir, "checkpoint-2")
    with open(os.path.join(ckpt, "dpzero_privacy.json")) as f:
        saved = json.load(f)
    assert saved["privacy"]["charges"] == 2 and "key" not in saved["privacy"]
    del first  # a resumed run is a new process: the ledger's writer lock goes with the engine
    gc.collect()
    # Resume from step 2 in the same output_dir: the ledger already holds 4 released steps, and
    # the two steps run again are new releases: 6 in all.
    again = PrivateTrainer(model=gpt2(), args=args, train_dataset=data, privacy_args=privacy)
    assert again.privacy_engine.charges == 4
    again.train(resume_from_checkpoint=ckpt)
    assert again.state.global_step == 4
    assert again.privacy_engine.charges == 6
    acc = dpzero.PRVAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=8 / N, num_steps=6)
    assert again.epsilon() == pytest.approx(float(acc.get_epsilon(again.delta)), rel=1e-9)
    # A checkpoint without the privacy state is refused.
    os.remove(os.path.join(ckpt, "dpzero_privacy.json"))
    del again
    gc.collect()
    third = PrivateTrainer(model=gpt2(), args=args, train_dataset=data, privacy_args=privacy)
    with pytest.raises(ValueError, match="dpzero_privacy.json"):
        third.train(resume_from_checkpoint=ckpt)


def _tokenizer(padding_side="right"):
    """A word-level tokenizer over VOCAB words, built offline."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(VOCAB - 1)}
    vocab["[PAD]"] = VOCAB - 1
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]",
                                                padding_side=padding_side)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(lm_data())


def _drop_last_row(rows):
    batch = transformers.default_data_collator(rows)
    return {k: v[:-1] for k, v in batch.items()}


@pytest.mark.parametrize("case, match", [
    ("neftune", r"neftune_noise_alpha=5"),
    ("label_smoothing", r"label_smoothing_factor=0.1"),
    ("compile", r"torch_compile=True"),
    ("auto_batch", r"auto_find_batch_size=True"),
    ("tokens_seen", r"include_num_input_tokens_seen='all'"),
    ("loss_func", r"compute_loss_func: .* per_sample_loss"),
    ("left_padding", r"pads on the left"),
    ("seed_and_secure", r"seed=5 with secure_mode=True"),
    ("fp16", r"fp16=True: .* GradScaler"),
    ("bf16_full_eval", r"bf16_full_eval=True: .* cast the model's parameters"),
    ("save_only_model", r"save_only_model=True"),
    ("optim", r"optim='adafactor'"),
    ("max_grad_norm", r"max_grad_norm=0.3"),
    ("no_len", r"_Stream\) has no __len__"),
    ("sigma_vs_accumulation", r"gradient_accumulation_steps=4"),
    ("budget", r"target_epsilon=1e-06 .* cannot be met"),
    ("no_privacy", r"needs target_epsilon .* or noise_multiplier"),
])
def test_bad_settings_are_refused_naming_the_value(tmp_path, case, match):
    data, privacy, extra, kw = lm_data(), PrivacyArguments(target_epsilon=2.0), {}, {}
    if case == "neftune":
        extra["neftune_noise_alpha"] = 5.0
    elif case == "label_smoothing":
        extra["label_smoothing_factor"] = 0.1
    elif case == "compile":
        extra["torch_compile"] = True
    elif case == "auto_batch":
        extra["auto_find_batch_size"] = True
    elif case == "tokens_seen":
        extra["include_num_input_tokens_seen"] = "all"
    elif case == "loss_func":
        kw["compute_loss_func"] = lambda outputs, labels, num_items_in_batch=None: 0.0
    elif case == "left_padding":
        kw["processing_class"] = _tokenizer(padding_side="left")
    elif case == "seed_and_secure":
        privacy = PrivacyArguments(target_epsilon=2.0, seed=5, secure_mode=True)
    elif case in ("fp16", "bf16_full_eval"):
        extra[case] = True
    elif case == "save_only_model":
        extra["save_only_model"] = True
    elif case == "optim":
        extra["optim"] = "adafactor"
    elif case == "max_grad_norm":
        extra["max_grad_norm"] = 0.3
    elif case == "no_len":
        data, extra["max_steps"] = _Stream(), 4
    elif case == "sigma_vs_accumulation":
        extra.update(gradient_accumulation_steps=4, num_train_epochs=3)
        privacy = PrivacyArguments(noise_multiplier=0.6, target_epsilon=1.0)
    elif case == "budget":
        privacy = PrivacyArguments(target_epsilon=1e-6)
    elif case == "no_privacy":
        privacy = PrivacyArguments()
    model = gpt2()
    with pytest.raises(ValueError, match=match):
        PrivateTrainer(model=model, args=trainer_args(tmp_path, **extra), train_dataset=data,
                       privacy_args=privacy, **kw)


def test_collator_that_drops_rows_is_refused(tmp_path):
    trainer = PrivateTrainer(model=gpt2(), args=trainer_args(tmp_path, max_steps=2),
                             train_dataset=lm_data(), data_collator=_drop_last_row,
                             privacy_args=PrivacyArguments(noise_multiplier=1.0))
    with pytest.raises(ValueError, match=r"collator returned a batch whose dim 0 is not its examples"):
        trainer.train()
    assert trainer.privacy_engine.charges == 0


def test_trainer_parallel_wrappers_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"fsdp=.*dpzero's own ZeRO stages"):
        PrivateTrainer(model=gpt2(), args=trainer_args(tmp_path, fsdp="full_shard"),
                       train_dataset=lm_data(), privacy_args=PrivacyArguments(target_epsilon=2.0))
    # TrainingArguments itself refuses a DeepSpeed config unless deepspeed is installed (it is
    # not here), so the setting is made after construction, as an installed one would leave it.
    args = trainer_args(tmp_path)
    args.deepspeed = {"zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=r"deepspeed=\{'zero_optimization'.*own ZeRO stages"):
        PrivateTrainer(model=gpt2(), args=args, train_dataset=lm_data(),
                       privacy_args=PrivacyArguments(target_epsilon=2.0))


def test_budget_stops_training_cleanly(tmp_path, capsys):
    # σ calibrated for 6 steps at ε = 2 is the budget. A first run takes 4 of them (checkpoint at
    # 2); resumed from step 2 towards 6 in the same output_dir, the ledger's 4 charges leave 2:
    # training stops at global step 4 with a message, and a run with nothing left trains nothing.
    data = lm_data()
    q, delta = 8 / N, min(1e-5, 1 / (10 * N))
    sigma = dpzero.get_noise_multiplier(target_epsilon=2.0, target_delta=delta, sample_rate=q,
                                        steps=6, accountant="prv")
    privacy = PrivacyArguments(noise_multiplier=sigma, target_epsilon=2.0)
    first = PrivateTrainer(model=gpt2(), train_dataset=data, privacy_args=privacy,
                           args=trainer_args(tmp_path, max_steps=4, save_strategy="steps",
                                             save_steps=2))
    first.train()
    del first
    gc.collect()
    args = trainer_args(tmp_path, max_steps=6, save_strategy="no")
    again = PrivateTrainer(model=gpt2(), args=args, train_dataset=data, privacy_args=privacy)
    assert again.privacy_engine.remaining_steps == 2
    again.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    assert again.state.global_step == 4 and again.privacy_engine.charges == 6
    assert "privacy budget ε = 2.0" in capsys.readouterr().out
    assert again.epsilon() <= 2.0
    del again
    gc.collect()
    spent = PrivateTrainer(model=gpt2(), args=args, train_dataset=data, privacy_args=privacy)
    with pytest.raises(dpzero.BudgetExhausted, match="already spent: 6 steps"):
        spent.train()
    assert spent.privacy_engine.charges == 6


def test_a_fresh_run_into_an_output_dir_with_a_ledger_is_refused(tmp_path):
    # Without resume_from_checkpoint a new run would start from scratch while the reopened
    # ledger counts the earlier run's steps: refused, and nothing is charged.
    data, privacy = lm_data(), PrivacyArguments(noise_multiplier=1.0)
    first = PrivateTrainer(model=gpt2(), args=trainer_args(tmp_path, max_steps=2),
                           train_dataset=data, privacy_args=privacy)
    first.train()
    first.train()  # the same trainer again: its own steps, not an earlier run's
    assert first.privacy_engine.charges == 4
    del first
    gc.collect()
    again = PrivateTrainer(model=gpt2(), args=trainer_args(tmp_path, max_steps=2),
                           train_dataset=data, privacy_args=privacy)
    with pytest.raises(ValueError, match=r"already holds a privacy ledger with 4 charged steps"):
        again.train()
    assert again.privacy_engine.charges == 4


def test_nothing_data_dependent_is_released(tmp_path, capsys):
    # Secure mode by default (TrainingArguments.seed is public); no realised batch size in the
    # Trainer's state: total_flos is not counted. A privacy review found the training loss in the
    # console, the logs and trainer_state.json (two neighbouring runs with identical weights at
    # step 2 logged 2.3189 and 3.8477), and train_runtime and the throughputs, which follow the
    # realised batch sizes: they go to output_dir/private/ now, as dpzero train keeps them.
    args = trainer_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=3,
                        disable_tqdm=False)
    trainer = PrivateTrainer(model=gpt2(), args=args, train_dataset=lm_data(),
                             privacy_args=PrivacyArguments(target_epsilon=2.0))
    assert trainer.privacy_engine.secure_mode
    output = trainer.train()
    with open(os.path.join(args.output_dir, "checkpoint-3", "trainer_state.json")) as f:
        state = json.load(f)
    assert state["total_flos"] == 0
    released = {"learning_rate", "epsilon", "delta", "epoch", "step", "total_flos"}
    for entry in trainer.state.log_history + state["log_history"]:
        assert set(entry) <= released, set(entry) - released
    assert math.isnan(output.training_loss) and set(output.metrics) <= released
    console = capsys.readouterr()
    for name in ("loss", "train_runtime", "samples_per_second"):
        assert name not in console.out + console.err, name
    # The training bar shows steps and ε, no times or rates ("1/3 [00:01<00:02, 1.2it/s]").
    assert "/3 |" not in console.err and not re.search(r"\d/3 \[", console.err)
    assert re.search(r"3/3, epsilon=", console.err)
    private = os.path.join(args.output_dir, "private")
    rows = [json.loads(line) for line in open(os.path.join(private, "training.jsonl"))]
    assert rows[0]["private"] is True and "NOT covered" in rows[0]["warning"]
    assert [r["step"] for r in rows[1:] if "loss" in r] == [1, 2, 3]
    assert any("train_runtime" in r for r in rows[1:])
    diagnostics = [json.loads(line) for line in open(os.path.join(private, "diagnostics.jsonl"))]
    assert [r["step"] for r in diagnostics[1:]] == [0, 1, 2]
    with open(os.path.join(args.output_dir, "checkpoint-3", "dpzero_privacy.json")) as f:
        saved = json.load(f)["privacy"]
    assert saved["seed"] is None and "key" not in saved


def test_a_released_training_loss_says_it_is_not_covered_by_epsilon(tmp_path):
    args = trainer_args(tmp_path, max_steps=2)
    trainer = PrivateTrainer(model=gpt2(), args=args, train_dataset=lm_data(),
                             privacy_args=PrivacyArguments(target_epsilon=2.0,
                                                           release_training_loss=True))
    output = trainer.train()
    logged = [h for h in trainer.state.log_history if "epsilon" in h]
    assert all("loss_not_covered_by_epsilon" in h and "loss" not in h for h in logged[:2])
    assert math.isfinite(output.training_loss)
    assert "train_loss_not_covered_by_epsilon" in output.metrics
    assert "train_runtime" not in output.metrics


def test_resuming_into_another_output_dir_is_refused(tmp_path):
    args = trainer_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    privacy = PrivacyArguments(noise_multiplier=1.0)
    first = PrivateTrainer(model=gpt2(), args=args, train_dataset=lm_data(), privacy_args=privacy)
    first.train()
    ckpt = os.path.join(args.output_dir, "checkpoint-2")
    other = trainer_args(tmp_path, max_steps=4, output_dir=str(tmp_path / "elsewhere"))
    again = PrivateTrainer(model=gpt2(), args=other, train_dataset=lm_data(),
                           privacy_args=privacy)
    with pytest.raises(ValueError, match=r"after 2 charged steps, but the ledger .*elsewhere"):
        again.train(resume_from_checkpoint=ckpt)
    assert again.privacy_engine.charges == 0


def test_right_padding_keeps_each_example_s_loss_its_own():
    # Note [trainer loss]: padded to the micro-batch's longest row (right padding, attention
    # mask), each example's loss is the one it has alone, unpadded.
    from dpzero.hf.losses import token_losses
    tok = _tokenizer()
    model = gpt2().eval()
    texts = [" ".join(f"w{(3 * i + j) % (VOCAB - 1)}" for j in range(n))
             for i, n in enumerate((3, 8, 5))]
    rows = [dict(tok(t), labels=tok(t)["input_ids"]) for t in texts]
    batch = transformers.DataCollatorForTokenClassification(tok)(rows)
    with torch.no_grad():
        together = token_losses(model(input_ids=batch["input_ids"],
                                      attention_mask=batch["attention_mask"]).logits,
                                batch["labels"], shift=True)
        for i, r in enumerate(rows):
            ids = torch.tensor([r["input_ids"]])
            alone = F.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:])
            torch.testing.assert_close(together[i], alone, rtol=1e-5, atol=1e-6)


_JOB = """
import os, signal, sys, torch, transformers
sys.path.insert(0, {tests!r})
from test_hf_trainer import gpt2, lm_data, trainer_args
from dpzero.hf import PrivacyArguments, PrivateTrainer
import pathlib

class Kill(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == int(os.environ.get("KILL_AT", "0")):
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no cleanup, no flush

args = trainer_args(pathlib.Path({tmp!r}), max_steps=8, save_strategy="steps", save_steps=2)
trainer = PrivateTrainer(model=gpt2(), args=args, train_dataset=lm_data(), callbacks=[Kill()],
                         privacy_args=PrivacyArguments(noise_multiplier=1.0, seed=11))
trainer.train(resume_from_checkpoint=bool(os.environ.get("RESUME")))
"""


@pytest.mark.job
def test_kill_9_then_resume_loses_nothing_and_counts_every_step_once(tmp_path):
    import signal
    import subprocess
    import sys
    job = tmp_path / "job.py"
    job.write_text(_JOB.format(tests=os.path.dirname(os.path.abspath(__file__)),
                               tmp=str(tmp_path)))
    env = dict(os.environ, KILL_AT="5")
    killed = subprocess.run([sys.executable, str(job)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    out = tmp_path / "out"
    ledger = dpzero.Ledger.open_read_only(str(out / "ledger.jsonl"))
    assert ledger.total_steps == 5  # every released step is on disk before its update
    assert sorted(os.listdir(out))[:2] == ["checkpoint-2", "checkpoint-4"]
    env = dict(os.environ, RESUME="1")
    resumed = subprocess.run([sys.executable, str(job)], env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # Steps 5..8 trained again from checkpoint-4: 4 more releases, 9 in the ledger; ε is the
    # accountant's for 9 steps, and the report says so.
    ledger = dpzero.Ledger.open_read_only(str(out / "ledger.jsonl"))
    assert ledger.total_steps == 9
    acc = dpzero.PRVAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=8 / N, num_steps=9)
    delta = min(1e-5, 1 / (10 * N))
    with open(out / "report.json") as f:
        report = json.load(f)
    assert report["steps"] == 9
    prv = next(r for r in report["epsilon"]["results"] if r["accountant"] == "prv")
    assert prv["epsilon"] == pytest.approx(float(acc.get_epsilon(delta)), rel=1e-6)
    # The logs continue: steps 1..8 logged once each (ε; the loss is private/training.jsonl's).
    with open(out / "checkpoint-8" / "trainer_state.json") as f:
        history = [h for h in json.load(f)["log_history"] if "epsilon" in h]
    assert [h["step"] for h in history] == list(range(1, 9))
    assert [h["epsilon"] for h in history] == sorted(h["epsilon"] for h in history)
    assert "loss" in (out / "private" / "training.jsonl").read_text()


_RANKS_JOB = """
import atexit, json, os, pathlib, sys, weakref, torch

# Note [ending a script]: the script frees nothing. This handler is registered before dpzero's
# (installed by its first engine), so it runs after it: by then the engine's C++ state and the
# process group must be gone, while the interpreter is whole.
held = {{}}
def after_release():
    alive = sorted(name for name, ref in held.items() if ref() is not None)
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(sys.argv[1], f"exit.{{rank}}.json"), "w") as f:
        json.dump({{"initialised": torch.distributed.is_initialized(), "alive": alive}}, f)
atexit.register(after_release)

sys.path.insert(0, {tests!r})
from test_hf_trainer import gpt2, lm_data, trainer_args
from dpzero.hf import PrivacyArguments, PrivateTrainer

out = pathlib.Path(sys.argv[1])
args = trainer_args(out, max_steps=4, per_device_train_batch_size=int(sys.argv[2]),
                    save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2)
trainer = PrivateTrainer(model=gpt2(), args=args, train_dataset=lm_data(),
                         eval_dataset=lm_data(8, seed=9),
                         privacy_args=PrivacyArguments(noise_multiplier=1.0, seed=11,
                                                       zero_stage=int(sys.argv[3])))
trainer.train()
state = {{n: p.detach().clone() for n, p in trainer.model.state_dict().items()}}  # every rank
if args.should_save:
    torch.save({{"state": state, "charges": trainer.privacy_engine.charges,
                "epsilon": trainer.epsilon(), "world": args.world_size}}, out / "final.pt")
held["zero"] = weakref.ref(trainer.privacy_engine.sharded.zero_state)
if torch.distributed.is_initialized():
    held["group"] = weakref.ref(torch.distributed.group.WORLD)
"""


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 3])
def test_two_ranks_under_torchrun_equal_one_rank(tmp_path, stage):
    # The same expected logical batch (8: 4 x 2 accumulation on one rank, 2 x 2 on each of two)
    # and seed give the same Poisson batches, split over the ranks, and the same noise: the
    # weights after 4 steps agree to float rounding, and so do the charges and ε. Stage 3 also
    # checkpoints sharded parameters and optimizer state through the Trainer's save. Both runs
    # evaluate every 2 steps: evaluation must leave the private model's parameters the engine's
    # (under torchrun the Trainer's accelerate preparation moved them to new storage once).
    import subprocess
    import sys
    job = tmp_path / "job.py"
    job.write_text(_RANKS_JOB.format(tests=os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, str(job), str(tmp_path / "one"), "4", str(stage)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = ranks.torchrun([job, tmp_path / "two", "2", str(stage)], 2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "terminate called" not in one.stderr + two.stderr
    # Each rank's atexit probe ran after dpzero's release: no group, no engine state left.
    for run, nproc in (("one", 1), ("two", 2)):
        for rank in range(nproc):
            with open(tmp_path / run / f"exit.{rank}.json") as f:
                assert json.load(f) == {"initialised": False, "alive": []}, (run, rank)
    a = torch.load(tmp_path / "one" / "final.pt")
    b = torch.load(tmp_path / "two" / "final.pt")
    assert (a["world"], b["world"]) == (1, 2)
    assert a["charges"] == b["charges"] == 4 and a["epsilon"] == pytest.approx(b["epsilon"])
    init = gpt2().state_dict()
    for name, value in a["state"].items():
        torch.testing.assert_close(b["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert max(float((a["state"][n] - init[n]).abs().max()) for n in init) > 1e-3
    assert os.path.exists(tmp_path / "two" / "out" / "checkpoint-2" / "dpzero_privacy.json")


@pytest.mark.parametrize("head", ["BartForCausalLM", "GPT2LMHeadModel", "LlamaForCausalLM"])
def test_per_example_loss_shifts_as_the_model_s_own_loss(head):
    # Note [trainer loss]: a causal LM head's labels are shifted by one only where the model's
    # own loss shifts them (GPT-2, Llama); the decoders of encoder-decoder families (Bart, ...)
    # take labels already shifted. Reference: the model's own loss, one example at a time with
    # every label valid (its mean is then the example's mean).
    from dpzero.hf.losses import default_per_sample_loss
    torch.manual_seed(0)
    if head == "BartForCausalLM":
        model = transformers.BartForCausalLM(transformers.BartConfig(
            vocab_size=VOCAB, d_model=16, decoder_layers=1, decoder_attention_heads=2,
            decoder_ffn_dim=32, max_position_embeddings=T, dropout=0.0))
    elif head == "GPT2LMHeadModel":
        model = gpt2()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T))
    model.eval()
    ids = torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(5))
    loss = default_per_sample_loss(model)
    with torch.no_grad():
        got = loss(model, model(input_ids=ids), labels)
        want = torch.stack([model(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss
                            for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_resume_loads_the_checkpoint_s_weights(tmp_path):
    # Resumed at its last step, a run trains nothing: the private model then holds exactly the
    # checkpoint's weights (the Trainer's load reached the engine's parameters).
    from safetensors.torch import load_file
    args = trainer_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    privacy = PrivacyArguments(noise_multiplier=1.0)
    first = PrivateTrainer(model=gpt2(), args=args, train_dataset=lm_data(), privacy_args=privacy)
    first.train()
    del first
    gc.collect()
    ckpt = os.path.join(args.output_dir, "checkpoint-2")
    saved = load_file(os.path.join(ckpt, "model.safetensors"))
    again = PrivateTrainer(model=gpt2(seed=5), args=args, train_dataset=lm_data(),
                           privacy_args=privacy)
    again.train(resume_from_checkpoint=ckpt)
    state = again.model.state_dict()
    assert again.privacy_engine.charges == 2  # nothing trained
    for name, value in saved.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(value, gpt2(seed=5).state_dict()[name])
               for name, value in saved.items())


def test_strict_isolation_through_the_trainer_equals_make_private(tmp_path):
    """PrivacyArguments(isolation="strict") is make_private's: the same two steps (σ = 0, the
    same seed, so the same Poisson batches) from the Trainer and by hand."""
    args = trainer_args(tmp_path, max_steps=2)
    trainer = PrivateTrainer(model=gpt2(), args=args, train_dataset=lm_data(),
                             privacy_args=PrivacyArguments(noise_multiplier=0.0,
                                                           allow_no_noise=True,
                                                           max_grad_norm=0.5, seed=7,
                                                           isolation="strict"))
    trainer.train()
    got = {n: t.detach().clone() for n, t in trainer.privacy_engine.parameters().items()}
    model = gpt2()
    p = dpzero.make_private(
        model, data_loader=DataLoader(lm_data(), batch_size=8,
                                      collate_fn=transformers.default_data_collator),
        noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=0.5, seed=7,
        max_physical_batch_size=4, loss_reduction="sum", optimizer="sgd", lr=0.05,
        isolation="strict")
    taken = 0
    while taken < 2:
        for batch in p.data_loader:
            example_loss("gpt2", p.model, batch).sum().backward()
            if p.optimizer.step():
                taken += 1
            p.optimizer.zero_grad()
            if taken == 2:
                break
    want = p.privacy_engine.parameters()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("strategy", ["sqrt_prefix_sum", "optimized"])
def test_a_banded_trainer_run_is_calibrated_for_one_step_in_b(tmp_path, strategy):
    """PrivacyArguments.bands: the run samples one of b partitions a step (q = b·B/N), σ is
    calibrated for the equivalent DP-SGD steps ⌈steps/b⌉ (Note [amplified banded accounting]),
    and the ledger and report reproduce ε from those alone; PrivacyArguments.strategy: the
    optimized strategy is fitted to the Trainer's steps (Note [run strategy])."""
    data = lm_data()
    trainer = PrivateTrainer(
        model=gpt2(), args=trainer_args(tmp_path, num_train_epochs=1), train_dataset=data,
        privacy_args=PrivacyArguments(target_epsilon=2.0, bands=2, strategy=strategy))
    q = 2 * 8 / N
    steps = 2 * int(1 / q)  # one epoch: b rows for each of its int(1/q) equivalent steps
    assert trainer.planned_steps == steps and trainer.sample_rate == pytest.approx(q)
    trainer.train()
    delta = min(1e-5, 1 / (10 * N))
    acc = dpzero.PRVAccountant()
    acc.step(noise_multiplier=trainer.noise_multiplier, sample_rate=q,
             num_steps=math.ceil(steps / 2))
    want = float(acc.get_epsilon(delta))
    assert want <= 2.0 + 1e-9
    assert trainer.epsilon() == pytest.approx(want, rel=1e-9)
    ledger = dpzero.accounting.Ledger.open_read_only(
        os.path.join(trainer.args.output_dir, "ledger.jsonl"))
    assert ledger.settings["bands"] == 2 and ledger.total_steps == steps
    assert ledger.settings["strategy"] == strategy
    want_strategy = (_C.privacy.BandedToeplitz.optimized(2, steps) if strategy == "optimized"
                     else _C.privacy.BandedToeplitz.sqrt_prefix_sum(2))
    assert ledger.settings["strategy_coefficients"] == want_strategy.coefficients
    assert ledger.settings.get("strategy_rows") == (steps if strategy == "optimized" else None)
    with open(os.path.join(trainer.args.output_dir, "report.json")) as f:
        report = json.load(f)
    assert report["bands"] == 2 and report["phases"][0]["steps"] == math.ceil(steps / 2)
    with open(os.path.join(trainer.args.output_dir, "report.md")) as f:
        assert f"bands = 2 (strategy {strategy}" + (
            f", fitted to {steps} steps)" if strategy == "optimized" else ")") in f.read()
    prv = [r for r in report["epsilon"]["results"] if r["accountant"] == "prv"]
    assert prv[0]["epsilon"] == pytest.approx(want, rel=1e-6)
