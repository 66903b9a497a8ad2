"""Eq. 1's attention maps outside grpo.py's training forward: a forward of their own, or one you do not call.

Paper (FlowTracer): "How Does Reasoning Flow?", §3.3 and App. C.2: the head- and layer-mean attention of the
middle layers is the DAG W of eq. 1. grpo.py takes it inside its training forward (flowtracer.Capture); here:

    attention_graph(model, input_ids, attention_mask, layers)  -> (B, T, T)   a no-grad forward that stops
                                                                              after the last chosen layer
    with capturing(model, mask, layers) as cap: model(...)     -> cap.attn    TRL's training forward
    use_capture_attention(model)                                           the attention function that
                                                                              takes the maps (capture_impl)
    capture_impl(model)      "sdpa_capture", "eager_capture" or None: which the model runs, chosen here alone
    capture_problem(model)   the one line that refuses a credit reading maps on a model without either

App. C.2 runs the eager attention path to materialise all maps; these recompute only the chosen layers' maps
in query chunks (flowtracer.add_head_mean, equal to eager to 1e-5 in tests/credit/test_attention.py), far less
memory. Padding query rows and padding keys are zero (eager gives padding queries uniform rows).
A model that SDPA cannot compute (transformers' _supports_sdpa False: Gemma-2's logit soft-capping,
GPT-OSS's attention sinks; forcing SDPA would drop them) keeps its own eager attention ("eager_capture",
flowtracer.eager_capture_attention), whose probabilities the chosen layers hand over as they are: the flow
is that of the attention the model computes, and each layer then holds its (B, H, T, T) probabilities
(training/memory/terms.py's eager_saved). A model whose attention does not run through transformers'
AttentionInterface can be neither: the credits that read maps (flow, attention, fai) refuse it at
construction, in one line naming the credits that read none (capture_problem).

Run the tests: python -m pytest -q tests/credit/test_attention.py
"""

import sys

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from flowtracer import EAGER_IMPL, IMPL, Capture, _Stop, register_attention, select_layers

MAP_CREDITS = ("flow", "attention", "fai")  # the --credit signals that read attention maps


def _check_inputs(input_ids, attention_mask, chunk):
    if input_ids.ndim != 2 or attention_mask is None or attention_mask.shape != input_ids.shape:
        raise ValueError("attention capture needs input_ids and attention_mask, both (B, T)")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    if (attention_mask.sum(-1) == 0).any():
        raise ValueError("attention capture got a row with no valid token (attention_mask all zero)")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive number of query rows (or None), got {chunk!r}")


class capturing:
    """Context manager for a forward that you do not call yourself (TRL's training forward): `model`'s next
    decoder forward is given a Capture (a pre-hook adds flow_capture=...), under the capture's attention
    (capture_impl).
    After the block, `.attn` is the (B, T, T) layer mean, zero on padding, as attention_graph returns it.

        with capturing(model, mask, "middle") as cap:
            out = model(input_ids, attention_mask=mask, ...)   # the training forward, with grad
        cap.attn  # (B, T, T); cap.layers: the chosen layers
    Where you call the forward yourself, pass a Capture instead (token_logprobs(..., capture=cap))."""

    def __init__(self, model, attention_mask, layers=None, chunk=None):
        self.model, self.mask = model, attention_mask.long()
        self.layers = select_layers(layers, model.config.num_hidden_layers)
        self.state, self.attn = Capture(self.layers, chunk), None

    def __enter__(self):
        self.old = use_capture_attention(self.model)
        give = lambda module, args, kwargs: (args, {**kwargs, "flow_capture": self.state})  # noqa: E731
        self.hook = self.model.get_decoder().register_forward_pre_hook(give, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.hook.remove()
        if self.old != self.model.config._attn_implementation:
            self.model.set_attn_implementation(self.old)
        if exc[0] is None:
            self.attn = self.state.maps(self.mask)
        return False


def capture_impl(model):
    """The attention function under which `model` (a model, a peft model's base, a class, or a config: its
    causal LM's) gives a Capture its maps, chosen here alone: "sdpa_capture" where transformers runs the
    class under SDPA, "eager_capture" (its own eager attention, wrapped) where it does not, None where the
    class does not run its attention through transformers' AttentionInterface (neither can be put in)."""
    if isinstance(model, PretrainedConfig):
        cls = AutoModelForCausalLM._model_mapping[type(model)]
    else:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        cls = base if isinstance(base, type) else type(base)
    if not cls._can_set_attn_implementation():  # its attention ignores AttentionInterface (transformers')
        return None
    if cls._supports_sdpa:
        return IMPL
    own = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    return EAGER_IMPL if callable(own) else None


def capture_problem(model, credit=None):
    """The one line that refuses a credit reading attention maps (`credit`; None: the caller's) on a model
    whose attention can be neither captured nor wrapped (capture_impl None: the caller has asked)."""
    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
    return (
        f"{f'--credit {credit}' if credit else 'this credit'} reads attention maps, and {name} runs its "
        f"attention outside transformers' AttentionInterface (neither SDPA nor its eager attention can be "
        f"captured): train it with a credit that reads none (--credit entropy, none)"
    )


def eager_line(model):
    """The one line that says a model gives its maps from its own eager attention (capture_impl
    "eager_capture": the caller has asked)."""
    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
    return (
        f"attention: {name} runs without SDPA in transformers (as Gemma-2's soft-capping and GPT-OSS's "
        f"sinks need): its own eager attention gives the maps, each layer holding its (B, H, T, T) "
        f"probabilities"
    )


def use_capture_attention(model):
    """Switch `model` to its capture attention (capture_impl: sdpa + the capture, or its own eager attention +
    the capture); returns the old name. A model with none: ValueError (capture_problem's line)."""
    old, impl = model.config._attn_implementation, capture_impl(model)
    if impl is None:
        raise ValueError(capture_problem(model))
    if old != impl:
        register_attention()
        model.set_attn_implementation(impl)
    if model.config._attn_implementation != impl:
        raise ValueError(f"{type(model).__name__} cannot switch to a custom AttentionInterface function")
    return old


@torch.no_grad()
def attention_graph(model, input_ids, attention_mask, layers=None, chunk=None):
    """(B, T, T) float32: attention probabilities averaged over all heads of the chosen layers (Eq. 1).

    out[b, k, i] = weight of query k on key i; zero for i > k, for padding keys and for padding query rows.
    `layers`: a spec for select_layers (default: middle layers). `chunk`: query rows per softmax block.
    Its own no-grad forward, which stops after the last chosen layer (a Capture with stop_after_last);
    the training forward takes the same maps on its way (grpo.update)."""
    _check_inputs(input_ids, attention_mask, chunk)
    cap = Capture(select_layers(layers, model.config.num_hidden_layers), chunk, stop_after_last=True)
    mask = attention_mask.to(input_ids.device).long()  # (B, T)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T), as HF generate
    old_impl, was_training = use_capture_attention(model), model.training
    try:
        model.eval()
        model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=False,
            flow_capture=cap,
        )
        raise RuntimeError("the forward pass ended without reaching the last chosen layer")
    except _Stop:
        pass
    finally:
        if old_impl != model.config._attn_implementation:
            model.set_attn_implementation(old_impl)
        model.train(was_training)
    return cap.maps(mask)  # layer mean, zero on padding
