"""The prompts: the text a model continues for a task record, in the style its model family was trained on.

  make_prompt(record, tokenizer, style) -> the prompt text (data.make_prompt is this function)
  turns(record, style)                  -> the chat turns make_prompt renders (None: a plain-text style)
  default_style(model_name, task)       -> the style of a model family
  INSTRUCTION, FEWSHOT, EXTRA_EXEMPLAR  App. E.1's instruction, App. C.3's two exemplars, our third one

Prompt styles, and the model families that use them (default_style):
  fewshot    the Llama models of the paper, Llama-3.1-8B and Llama-3.2-3B, and the other Llama-3.x models
             that are not instruct-tuned: App. C.3's prompt, its two exemplars (FEWSHOT) as earlier
             user/assistant turns, then the question. The paper bypasses SFT on these models and starts RL
             from few-shot prompting.
  fewshot3   the embedded SmolLM2-135M-Instruct (and GGUF files): FEWSHOT plus our third exemplar
             (departure 3); zero-shot, SmolLM2 never writes a \\boxed{}. Not a paper setting.
  oneshot    our third exemplar alone: a prompt a third as long, for cheap CPU learning runs (eval.py learn)
  chat       instruct / thinking models (Qwen3, Llama-3.x-Instruct, anything not named below): one user turn
             that ends with "Please reason step by step, and put your final answer within \\boxed{}."
             (App. E.1)
  plain      models named "...base..." (Qwen3-4B-Base): App. E.1's template as plain text (instruction,
             "Question: ...", "Answer:"); the paper gives no training prompt for them
  countdown  every model on Countdown: TinyZero's "User: ... Assistant: ... <think>" frame
  question   a custom task's records (--dataset custom), any model: the question as written, one user turn
             of the chat template, no instruction (the task defines its own answer format)
  Without a chat template (or with tokenizer=None), turns are rendered as "User: ...\\n\\nAssistant: ...",
  and "question" is the question alone. template_kwargs (grpo.py --chat-template-kwargs, e.g.
  {"enable_thinking": false} for Qwen3) go to apply_chat_template.

Departures (numbered; data.py goes on from 4):
  1. App. E.1 puts the instruction in a system turn; "chat" ends the user turn with it (our choice,
     the Qwen math convention and the shape of the App. C.3 exemplars).
  2. App. C.3's second exemplar lost its line breaks in the PDF; it is laid out like the first.
  3. "fewshot3" adds a third exemplar, ours (EXTRA_EXEMPLAR), for SmolLM2 only: a one-step problem in the
     arithmetic task's style, whose name and item never occur there. (A two-step one made SmolLM2 add a
     spurious step to one-step problems: 3% vs 29%.) The paper's Llama prompt ("fewshot") has only its two.

Run: python data.py --task arithmetic --split test --limit 3 --style fewshot3
Test: python -m pytest -q tests/tasks/test_prompts.py tests/test_data.py -k "prompt or style or exemplar"
"""

from tasks import countdown

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."  # App. E.1

FEWSHOT = [  # App. C.3's two exemplars, the Llama prompt (departure 2)
    (
        "Calculate $12 + 8 * 2$.",
        "According to the order of operations, we first perform multiplication, then addition.\n"
        "Step 1. $8 * 2 = 16$.\nStep 2. $12 + 16 = 28$.\nThe final answer is \\boxed{28}.",
    ),
    (
        "Solve the equation: $2x - 5 = 5$.",
        "To find the value of x, we need to isolate the variable.\n"
        "Step 1: Add 5 to both sides of the equation: $2x = 10$.\nStep 2: Divide both sides by 2: $x = 5$.\n"
        "The final answer is \\boxed{5}.",
    ),
]
EXTRA_EXEMPLAR = (
    "Mia has 6 stickers. She buys 4 more stickers. How many stickers does Mia have now?",
    "Mia has 6 stickers and buys 4 more: $6 + 4 = 10$.\nThe final answer is \\boxed{10}.",
)
EXEMPLARS = {
    "fewshot": FEWSHOT,
    "fewshot3": FEWSHOT + [EXTRA_EXEMPLAR],  # departure 3
    "oneshot": [EXTRA_EXEMPLAR],
}
STYLES = ("chat", "plain", "fewshot", "fewshot3", "oneshot", "countdown", "question")


def has_template(tokenizer):
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render(messages, tokenizer, template_kwargs=None):
    """Chat turns through the tokenizer's chat template (with template_kwargs), or as "User: ..." text when it
    has none."""
    if has_template(tokenizer):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"


def default_style(model_name, task):
    """The prompt style a model family uses (see the module docstring): the Countdown frame for Countdown,
    App. C.3's few-shot for Llama-3.x non-instruct models, fewshot3 for SmolLM2 and GGUF files, plain for base
    models, chat otherwise."""
    name = str(model_name).lower()
    if task == "custom":
        return "question"
    if task == "countdown":
        return "countdown"
    if "llama-3" in name and "instruct" not in name:  # meta-llama/Llama-3.1-8B, meta-llama/Llama-3.2-3B
        return "fewshot"
    if "smollm2" in name or name.endswith(".gguf"):
        return "fewshot3"
    return "plain" if "base" in name else "chat"


def style_fits(style, task):
    """Whether make_prompt takes this style for records of this task ("countdown", "math" or "choice"; a
    data.TASKS name: data.style_fits): the countdown frame for Countdown only, the math exemplars never."""
    return (style == "countdown") == (task == "countdown") or style in ("auto", "chat", "plain", "question")


def turns(record, style="chat"):
    """The chat turns make_prompt renders for `record` in `style` (through the chat template, or as "User:"
    text without one), or None for the styles written as plain text (plain, countdown): what a --reward
    function in TRL's form gets as its prompt when a chat template renders it
    (training/usercode/reward_code.py)."""
    q, is_countdown = record["question"], record["task"] == "countdown"
    if style in ("countdown", "plain"):
        return None
    if style == "question":
        return [{"role": "user", "content": q}]
    if style == "chat":
        return [{"role": "user", "content": q if is_countdown else f"{q}\n{INSTRUCTION}"}]
    shots = [
        [{"role": "user", "content": f"{u} {INSTRUCTION}"}, {"role": "assistant", "content": a}]
        for u, a in EXEMPLARS[style]
    ]
    return sum(shots, []) + [{"role": "user", "content": f"{q} {INSTRUCTION}"}]


def make_prompt(record, tokenizer=None, style="chat", template_kwargs=None):
    """The prompt text for one record (see the module docstring for which style fits which model);
    template_kwargs: extra arguments of apply_chat_template ({"enable_thinking": False})."""
    if style not in STYLES:
        raise ValueError(f"unknown prompt style {style!r}; styles: {', '.join(STYLES)}")
    q, is_countdown = record["question"], record["task"] == "countdown"
    if not style_fits(style, record["task"]):  # the countdown frame on math, math exemplars on Countdown
        raise ValueError(
            f"style {style!r} has math exemplars; use countdown or chat for countdown records"
            if is_countdown
            else "style 'countdown' is for countdown records; use chat, plain or fewshot"
        )
    messages = turns(record, style)
    if style == "countdown" or (style == "plain" and is_countdown):
        return countdown.frame(q)
    if style == "plain":
        return f"{INSTRUCTION}\n\nQuestion: {q}\nAnswer:"  # App. E.1's template, without the chat roles
    if style == "question" and not has_template(tokenizer):
        return q  # the question as written
    return render(messages, tokenizer, template_kwargs)


def template_variables(tokenizer):
    """The names the tokenizer's chat template reads (jinja2's undeclared variables: messages,
    add_generation_prompt, enable_thinking, ...), or None when it has none or it does not parse: what
    grpo.py checks each --chat-template-kwargs key against (a misspelt key is read by nothing)."""
    if not has_template(tokenizer):
        return None
    import jinja2
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    templates = tokenizer.chat_template
    try:
        return set().union(
            *(
                meta.find_undeclared_variables(env.parse(t))
                for t in (templates.values() if isinstance(templates, dict) else [templates])
            )
        )
    except jinja2.TemplateError:  # a tag only transformers knows ({% generation %}): unknown
        return None


def unread_kwargs(tokenizer, style, template_kwargs):
    """Why some of template_kwargs (--chat-template-kwargs) reach nothing, as one sentence, or None: the style
    writes plain text, the tokenizer has no chat template, a key (tools, documents and chat_template
    aside: apply_chat_template's own) is a name the template never reads (a misspelling: jinja2 leaves an
    unknown name undefined, without a word), or a value is the string "false" (true to jinja2)."""
    if not template_kwargs:
        return None
    if style in ("plain", "countdown"):
        return f"the {style!r} prompt style writes plain text, so no chat template reads them"
    if not has_template(tokenizer):
        return "the tokenizer has no chat template, so nothing reads them"
    reads = template_variables(tokenizer)
    unread = [
        k
        for k in template_kwargs
        if reads is not None and k not in reads and k not in ("tools", "documents", "chat_template")
    ]
    words = [k for k, v in template_kwargs.items() if isinstance(v, str) and v.lower() in ("false", "true")]
    if not unread and words:  # jinja2 reads the string "false" as true
        return (
            f"{', '.join(map(repr, words))} is a string ({template_kwargs[words[0]]!r}), which the "
            f"template reads as true: write JSON's false / true, without quotes"
        )
    if not unread:
        return None
    import difflib

    near = [m for k in unread for m in difflib.get_close_matches(k, sorted(reads), n=1)]
    return (
        f"the chat template never reads {', '.join(map(repr, unread))}"
        + (f" (did you mean {', '.join(map(repr, near))}?)" if near else "")
        + f"; it reads {', '.join(sorted(reads)) or 'nothing'}"
    )
