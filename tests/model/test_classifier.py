"""Sequence classifiers (``*ForSequenceClassification``: rerankers, reward models): tiny
random Llama, Qwen3, Gemma 2 and Gemma 3 (text) checkpoints written by transformers load without an LM head
and with their ``score`` head; the head over the last token's final hidden state gives
transformers' logits in float32, at tp 1 and 2; their labels are read from ``id2label``;
``--runner auto`` serves them pooling and ``generate`` is refused."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_tiny_models import TINY
from tests.model.util import full_logits, load, new_pool, save_hf_folder, tiny_hf_model
from tpserve.model.config import ModelConfig
from tpserve.model.plan import SeqChunk
from tpserve.model.pooling import (
    classification_scores,
    classifier_head,
    cross_encoder_score,
    finish_classification,
    resolve_pooler_config,
    resolve_runner,
)
from tpserve.parallel.launch import run_ranks

TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12]
LABELS = {"llama": {0: "bad", 1: "good", 2: "neutral"}, "qwen3": {0: "relevance"},
          "gemma2": {0: "LABEL_0", 1: "LABEL_1"}, "gemma3": {0: "score"}}


def _hf_classifier(kind: str):
    import transformers as tf

    torch.manual_seed({"llama": 50, "qwen3": 51, "gemma2": 52, "gemma3": 56}[kind])
    labels = LABELS[kind]
    common = dict(id2label=labels, label2id={v: k for k, v in labels.items()},
                  num_labels=len(labels), pad_token_id=0)
    if kind == "llama":
        cfg = tf.LlamaConfig(**TINY, rope_theta=10000.0, **common)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**TINY, head_dim=32, rope_theta=1000000.0, **common)
    elif kind == "gemma2":
        cfg = tf.Gemma2Config(**{**TINY, "head_dim": 32}, sliding_window=6,
                              query_pre_attn_scalar=24, **common)
    else:
        cfg = tf.Gemma3TextConfig(**{**TINY, "head_dim": 32}, sliding_window=6,
                                  layer_types=["sliding_attention", "full_attention"],
                                  query_pre_attn_scalar=24, **common)
    name = type(cfg).__name__.replace("Config", "ForSequenceClassification")
    cfg.architectures = [name]
    model = getattr(tf, name)(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name == "score.weight":
                p.mul_(20.0)  # logits of a few units, so the probabilities differ
    return model


@torch.no_grad()
def _last_logits(group, folder: str) -> torch.Tensor:
    model, comm = load(folder, group, lm_head=False)
    assert model.lm_head is None
    hidden = model(*_inputs(model))
    return classifier_head(model) @ hidden[-1].float()


def _inputs(model):
    from tpserve.model.plan import StepPlan

    pool = new_pool(model, model.comm)
    plan = StepPlan.build([SeqChunk(TOKENS, 0, [0], True)], pool.block_size,
                          model.attn_backend)
    return plan.input_ids, plan.positions, pool.layers, plan.metadata(model.attn_backend)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "gemma3"])
def test_classifier_head_equals_transformers(tmp_path, kind):
    hf = _hf_classifier(kind)
    folder = str(save_hf_folder(hf, tmp_path / kind))
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0]
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    assert cfg.labels == tuple(LABELS[kind][i] for i in range(len(LABELS[kind])))
    for tp in (1, 2):
        for got in run_ranks(_last_logits, tp, folder):
            assert (got - want).abs().max().item() < 1e-4, (kind, tp)
    n = len(cfg.labels)
    logits = finish_classification(torch.zeros(64), 1, "LAST", torch.zeros(n, 64))
    assert logits == [0.0] * n
    probs = classification_scores(logits, resolve_pooler_config(
        None, None, 64, None, cfg.labels).activation)
    assert probs == pytest.approx([0.5] if n == 1 else [1 / n] * n)


def test_a_classifier_has_no_lm_head_to_generate_with(tmp_path):
    hf = _hf_classifier("qwen3")
    folder = str(save_hf_folder(hf, tmp_path / "qwen3"))
    with pytest.raises(ValueError, match="has no place in the model|no LM head"):
        model, comm = load(folder)  # a generative build wants lm_head.weight
        full_logits(model, comm, TOKENS)
    assert resolve_runner("auto", classifier=True) == "pooling"
    assert resolve_runner("pooling", classifier=True) == "pooling"
    with pytest.raises(ValueError, match="sequence classifier"):
        resolve_runner("generate", classifier=True)
    pooler = resolve_pooler_config(None, None, 64, None, ("relevance",))
    assert pooler.classifies and pooler.pooling_type == "LAST" and not pooler.normalize
    assert "sigmoid" in pooler.describe()


def test_sigmoid_for_one_label_softmax_for_several():
    """The engine answers the head's logits; /classify's activation is vLLM's
    (get_classification_act_fn): sigmoid for one label, softmax over several."""
    head = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    v = torch.tensor([3.0, 1.0])
    assert finish_classification(v, 1, "LAST", head) == [3.0, 2.0]
    assert finish_classification(v * 4, 4, "MEAN", head[:1]) == [3.0]
    two = resolve_pooler_config(None, None, 2, None, ("a", "b"))
    one = resolve_pooler_config(None, None, 2, None, ("a",))
    assert (two.activation, one.activation) == ("softmax", "sigmoid")
    assert classification_scores([3.0, 2.0], two.activation) == pytest.approx(
        torch.softmax(torch.tensor([3.0, 2.0]), -1).tolist())
    assert classification_scores([3.0], one.activation) == pytest.approx(
        [torch.sigmoid(torch.tensor(3.0)).item()])


@pytest.mark.parametrize("problem_type", [None, "single_label_classification", "regression",
                                          "multi_label_classification"])
def test_problem_type_chooses_the_classify_activation(problem_type):
    """config.json's problem_type (transformers' Trainer writes it) as vLLM reads it
    (get_classification_act_fn): regression answers the logits, multi-label each label's
    sigmoid, else softmax (sigmoid for one label); /score's cross-encoder sigmoid whatever
    it is (get_cross_encoder_act_fn)."""
    hf = _hf_classifier("llama")
    hf.config.problem_type = problem_type
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    assert cfg.problem_type == problem_type
    for labels in (cfg.labels, cfg.labels[:1]):
        pooler = resolve_pooler_config(None, None, 64, None, labels, cfg.problem_type)
        assert pooler.problem_type == problem_type
        x = torch.tensor([2.0, -1.0, 0.5][:len(labels)])
        if problem_type == "regression":
            want = x
        elif problem_type == "multi_label_classification" or len(labels) == 1:
            want = torch.sigmoid(x)
        else:
            want = torch.softmax(x, -1)
        got = classification_scores(x.tolist(), pooler.activation)
        assert got == pytest.approx(want.tolist(), abs=1e-7), labels
    assert cross_encoder_score(2.0) == pytest.approx(torch.sigmoid(torch.tensor(2.0)).item())
    if problem_type in ("regression", "multi_label_classification"):
        assert problem_type in pooler.describe()
    with pytest.raises(ValueError, match="problem_type must be one of"):
        ModelConfig.from_hf({**hf.config.to_dict(), "problem_type": "ranking"})


def test_problem_type_reaches_the_servers_pooler(tmp_path):
    """``tpserve serve`` of a checkpoint whose config.json sets problem_type: the pooler
    /classify reads has it."""
    from tests.model.util import save_hf_folder
    from tpserve.cli import build_parser
    from tpserve.server.config import config_from_args

    hf = _hf_classifier("llama")
    hf.config.problem_type = "multi_label_classification"
    folder = str(save_hf_folder(hf, tmp_path / "multi-label"))
    parser, _ = build_parser()
    cfg = config_from_args(parser.parse_args(["serve", folder]))
    assert cfg.runner.pooler.problem_type == "multi_label_classification"
    assert cfg.runner.pooler.activation == "sigmoid"


# ------------------------------------------------- a causal LM as a classifier by tokens
QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
                  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}


def _causal_lm(kind: str):
    """A tiny causal LM over SmolLM2's vocabulary (its tokenizer names the label tokens):
    Qwen3 with tied embeddings (the label rows come from the embedding), Gemma untied."""
    import transformers as tf

    torch.manual_seed({"qwen3": 54, "gemma": 55}[kind])
    if kind == "qwen3":
        return tiny_hf_model(tf.Qwen3Config(**{**TINY, "vocab_size": 49152}, head_dim=32,
                                            rope_theta=1000000.0, tie_word_embeddings=True),
                             "Qwen3ForCausalLM")
    return tiny_hf_model(tf.GemmaConfig(**{**TINY, "vocab_size": 49152}, head_dim=32,
                                        tie_word_embeddings=False), "GemmaForCausalLM")


def _token_scores(group, folder: str, overrides: str) -> list[float]:
    model, _ = load(folder, group, lm_head=False, hf_overrides=overrides)
    with torch.no_grad():
        hidden = model(*_inputs(model))
    logits = finish_classification(hidden[-1].float(), 1, "LAST", classifier_head(model))
    return classification_scores(logits, "sigmoid")


@pytest.mark.parametrize("kind,overrides", [
    ("qwen3", QWEN3_RERANKER),  # Qwen3-Reranker's recipe: softmax over (no, yes)
    ("gemma", {"architectures": ["GemmaForSequenceClassification"],  # bge-reranker-v2-gemma
               "classifier_from_token": ["Yes"], "method": "no_post_processing"})])
def test_a_causal_lm_classifies_by_its_label_tokens(tmp_path, smollm2_tokenizer, kind,
                                                    overrides):
    """vLLM's ``classifier_from_token`` overrides: the score head is the LM head's rows of
    the label tokens (``from_2_way_softmax``: the true row less the false one, whose
    sigmoid is the two-way softmax's true probability; ``no_post_processing``: the rows
    as they are, a sigmoid of the one logit), at tp 1 and 2; equal to transformers' causal
    LM's last-position logits."""
    import json

    from tpserve.model.loader.hf_overrides import canonical_overrides

    hf = _causal_lm(kind)
    folder = save_hf_folder(hf, tmp_path / kind)
    smollm2_tokenizer.save_pretrained(folder)
    ids = [smollm2_tokenizer.convert_tokens_to_ids(t) for t in overrides["classifier_from_token"]]
    with torch.no_grad():
        logits = hf(torch.tensor([TOKENS])).logits[0, -1]
    if len(ids) == 2:
        want = [torch.softmax(logits[ids], -1)[1].item()]
    else:
        want = [torch.sigmoid(logits[ids[0]]).item()]
    text = canonical_overrides(json.dumps(overrides))
    cfg = ModelConfig.from_hf({**hf.config.to_dict(), **overrides})
    assert cfg.labels == (overrides["classifier_from_token"][-1],)
    for tp in (1, 2):
        for got in run_ranks(_token_scores, tp, str(folder), text):
            assert got == pytest.approx(want, abs=1e-5), (kind, tp)


def test_token_classifier_overrides_are_checked():
    base = dict(TINY, num_hidden_layers=2, architectures=["Qwen3ForSequenceClassification"])
    for extra, message in (
            ({"classifier_from_token": ["no", "yes"]}, "needs a method"),
            ({"classifier_from_token": ["no"], "method": "from_2_way_softmax"},
             "two tokens"),
            ({"classifier_from_token": ["a"], "method": "reward"}, "method 'reward'"),
            ({"classifier_from_token": [], "method": "no_post_processing"}, "non-empty"),
            ({"classifier_from_token": ["yes"], "method": "no_post_processing",
              "use_pad_token": True}, "use_pad_token")):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf({**base, **extra})
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        ModelConfig.from_hf({**base, **QWEN3_RERANKER, "architectures": ["Qwen3ForCausalLM"]})
