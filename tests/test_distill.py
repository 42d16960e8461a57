"""The distillation pipeline end to end on the tiny pair: teacher shards, training, resume, export."""

import pytest
import torch

from engine.distill.teacher_data import TeacherDataConfig, build, existing_shards
from engine.distill.train import TrainConfig, evaluate_drafts, export, train
from engine.distill.training_prompts import PROMPT_SETS, UNSEEN_SUBJECTS, broad_prompts, training_prompts, unseen_prompts
from engine.models.feature_draft import draft_card, load_feature_draft
from engine.prompts import held_out_prompts


def test_training_prompts_exclude_the_held_out_set():
    prompts = training_prompts()
    assert len(prompts) > 1000 and len(set(prompts)) == len(prompts)
    assert not set(prompts) & set(held_out_prompts())


def test_the_unseen_validation_prompts_share_no_subject_with_any_training_set():
    """The unseen set measures generalisation only if no training prompt mentions its subjects."""
    unseen = unseen_prompts()
    assert len(unseen) == len(set(unseen)) >= 64
    training = [p for name, make in PROMPT_SETS.items() if name != "unseen" for p in make()]
    assert not set(training) & (set(unseen) | set(held_out_prompts()))
    assert not [s for s in UNSEEN_SUBJECTS if any(s in p for p in training)]
    broad = broad_prompts()
    assert len(broad) > 3000 and len(set(broad)) == len(broad) and not set(broad) & set(training_prompts())


@pytest.fixture(scope="module")
def shards(tiny_pair, tmp_path_factory):
    work = tmp_path_factory.mktemp("distill")
    build(tiny_pair, TeacherDataConfig(out_dir=work / "data", shards=3, batch_size=6, max_new_tokens=16))
    build(tiny_pair, TeacherDataConfig(out_dir=work / "validation", shards=1, batch_size=6, max_new_tokens=16,
                                       prompt_set="unseen"))
    return work


def test_a_later_prompt_set_starts_at_its_first_shard(tiny_pair, tmp_path):
    build(tiny_pair, TeacherDataConfig(out_dir=tmp_path, shards=5, batch_size=2, max_new_tokens=4,
                                       prompt_set="broad", first_shard=3))
    paths = existing_shards(tmp_path)
    assert [p.name for p in paths] == ["shard_00003.pt", "shard_00004.pt"]
    prompts = broad_prompts()
    for index, path in enumerate(paths):
        shard = torch.load(path)
        for row in range(2):
            expected = tiny_pair.encode_prompt(prompts[index * 2 + row])
            assert shard["tokens"][row][: shard["prompt_lengths"][row]].tolist() == expected


def test_teacher_shards_hold_the_targets_own_features_and_top_k(tiny_pair, shards):
    paths = existing_shards(shards / "data")
    assert len(paths) == 3
    shard = torch.load(paths[1])
    tokens, feats, top = shard["tokens"][0], shard["features"][0], shard["top_ids"][0]
    assert len(tokens) == len(feats) == len(top) > shard["prompt_lengths"][0]
    target = tiny_pair.make_target("transformers")
    target.keep_hidden = True
    logits = target.forward(tokens.tolist(), last_n=len(tokens))
    torch.testing.assert_close(feats.float(), target.last_hidden, atol=2e-2, rtol=1e-2)  # stored as fp16
    assert torch.equal(top[:, 0], logits.argmax(-1))
    mtime = paths[0].stat().st_mtime
    build(tiny_pair, TeacherDataConfig(out_dir=shards / "data", shards=3, batch_size=6, max_new_tokens=16))
    assert paths[0].stat().st_mtime == mtime  # resumable: existing shards are kept


def test_training_lowers_the_loss_resumes_and_exports(tiny_pair, shards, tmp_path):
    logs = []
    cfg = TrainConfig(work_dir=shards, vocab_size=128, tokens=1500, batch_sequences=4, eval_every=4, lr=3e-3)
    train(tiny_pair.target_model, cfg, log=logs.append)
    first = torch.load(shards / "train" / "checkpoint.pt", weights_only=False)
    history = first["history"]
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert history["overlap_step1"][-1] > history["overlap_step1"][0]
    unseen = history["unseen_accept_step1"]
    assert len(unseen) == len(history["tokens_seen"]) and all(0.0 <= a <= 1.0 for a in unseen)
    assert unseen[-1] > unseen[0]
    cfg.tokens = 2500
    train(tiny_pair.target_model, cfg, log=logs.append)
    assert any(line.startswith(f"resumed at step {first['step']}") for line in logs)
    out = tmp_path / "draft.safetensors"
    card = export(tiny_pair.target_model, shards, out, "tiny test draft")
    assert draft_card(out)["steps"] == card["steps"] > first["step"]
    draft = load_feature_draft(out, tiny_pair.target_model)
    assert len(draft.vocab_ids) == 128
    table = evaluate_drafts(tiny_pair.target_model, shards, [out])
    assert f"| {out} | {card['tokens_seen']:,} |" in table


def test_the_acceptance_objective_raises_acceptance_by_gradient():
    """The total-variation loss is differentiable in the draft's log-probs, and descending it moves
    a random draft to the target's tempered, truncated distribution: the acceptance SpS would see
    rises to nearly one."""
    from engine.distill.train import acceptance_loss, expected_acceptance
    from engine.sampling import REPORTED_SAMPLING

    torch.manual_seed(0)
    vocab, top = 64, 20
    target_ids = torch.stack([torch.randperm(vocab)[:top] for _ in range(8)])
    target_logprobs = torch.log_softmax(torch.randn(8, top) * 2, dim=-1).sort(dim=-1, descending=True).values
    logits = torch.randn(8, vocab, requires_grad=True)
    inside = torch.ones_like(target_ids, dtype=torch.bool)
    opt = torch.optim.Adam([logits], lr=0.1)
    first = None
    for _ in range(200):
        logq = torch.log_softmax(logits, -1)
        if first is None:
            first = float(expected_acceptance(logq, target_ids, inside, target_logprobs, REPORTED_SAMPLING).mean())
        opt.zero_grad()
        acceptance_loss(logq, target_ids, inside, target_logprobs).backward()
        opt.step()
    final = expected_acceptance(torch.log_softmax(logits, -1), target_ids, inside, target_logprobs, REPORTED_SAMPLING)
    assert first < 0.3 and float(final.mean()) > 0.9
