"""One BOS: a chat template that writes the BOS, tokenized again with the tokenizer's special tokens, gives
two (Llama 3's template, TRL's default tokenization of a text prompt). rollout.prompt_ids adds special
tokens only to a text that does not begin with the BOS; rollout.generate's three paths and flowtracer_trl's
tokenization (the length filter and TRL's _tokenize_prompts) take the same ids. The tokenizer is built here,
offline, with the `tokenizers` library: a word-level vocabulary, a TemplateProcessing that adds the BOS."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from training.decode import rollout
from training.model.load import load_model

SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
WORDS = "what is two plus three ? five the answer".split()
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def llama_like_tokenizer():
    """A fast tokenizer whose post-processor adds <s> and whose chat template writes it too."""
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + ["<unk>"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        chat_template=TEMPLATE,
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    return tok


@pytest.fixture(scope="module")
def chat():
    """(tokenizer, a prompt its chat template rendered, BOS id)."""
    tok = llama_like_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "what is two plus three ?"}], tokenize=False, add_generation_prompt=True
    )
    return tok, text, tok.bos_token_id


def test_prompt_ids_give_one_bos(chat):
    """The default tokenization doubles the BOS (so the test can fail); prompt_ids keeps one, and still adds
    it to a text that lacks it."""
    tok, text, bos = chat
    assert text.startswith("<s>") and tok(text).input_ids[:2] == [bos, bos]
    ids, plain = rollout.prompt_ids(tok, [text, "what is two plus three ?"])
    assert ids[0] == bos and ids.count(bos) == 1 and ids == tok(text, add_special_tokens=False).input_ids
    assert plain[0] == bos and plain.count(bos) == 1 and plain[1:] == ids[2:-1]


def test_generate_reads_one_bos_on_every_path(chat):
    """Generations.prompt_ids hold the one-BOS ids on the shared path, the engine's and HF generate's, and
    the greedy rows agree (HF generate read the same ids)."""
    tok, text, bos = chat
    model, _ = load_model("tiny-llama", device="cpu")
    want = rollout.prompt_ids(tok, [text])[0]
    kw = dict(n=2, sampling=rollout.Sampling(6, greedy=True))
    runs = [
        rollout.generate(model, tok, [text, text + " five"], **kw, **extra)
        for extra in ({}, {"graphs": False}, {"share_prefix": False})
    ]
    for g in runs:
        assert g.prompt_ids[0] == g.prompt_ids[1] == want and want.count(bos) == 1
    assert runs[0] == runs[1] == runs[2]


def test_flowtracer_trl_tokenizes_prompts_the_same(chat):
    """flowtracer_trl's prompts reach TRL as text; its _tokenize_prompts (what TRL's generation reads) gives
    rollout.prompt_ids' ids, one BOS, where TRL's own gives two."""
    pytest.importorskip("trl", reason="flowtracer_trl needs trl: pip install -r requirements.txt")
    pytest.importorskip("datasets", reason="flowtracer_trl needs datasets: pip install -r requirements.txt")
    import flowtracer_trl as ft

    tok, text, bos = chat
    trainer = type("Stub", (), {"processing_class": tok})()
    ids, images, _ = ft.FlowTracerGRPOTrainer._tokenize_prompts(trainer, [text])
    assert ids == rollout.prompt_ids(tok, [text]) and ids[0].count(bos) == 1 and images is None
    assert ft.GRPOTrainer._tokenize_prompts(trainer, [text])[0][0][:2] == [bos, bos]  # TRL's own
