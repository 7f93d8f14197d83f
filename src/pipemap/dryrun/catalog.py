"""A catalog pipeline at full size for the dry run, with nothing downloaded.

Models are the real classes built from the published configs with fake weights (as a folder's dry run builds them);
tokenizers are stand-ins with the published maximum lengths, the scheduler the published class and config.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
from torch._subclasses.fake_tensor import FakeTensorMode

from ..catalog import component_dtype, entries, model_class, transformers_config
from ..inventory.folder import keep_in_fp32
from ..inventory.values import as_dtype
from ..plan import Plan
from ..quiet import quiet_diffusers
from . import standin

# a word-level vocabulary: every word and every run of punctuation is one token (<unk>), close to the token counts
# of the real subword tokenizers (Qwen-Image drops its 34-token prompt template by count), and every id is valid
# for any text encoder's embedding
_SPECIAL = {"<pad>": 0, "</s>": 1, "<unk>": 2, "<s>": 3}
# a chat template for pipelines that build their prompt from messages (FLUX.2's Mistral encoder): each text part in
# turn, so a message costs its words, as the real templates do give or take their few markers
_CHAT = ("{% for message in messages %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
         "{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}")
# the text encoder config's ids of the vision tokens a Qwen2-VL processor writes into the prompt
_VISION_TOKENS = {"<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id",
                  "<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id"}
_VISION_PROCESSORS = {"Qwen2VLProcessor", "Qwen2_5_VLProcessor"}


def pipeline(name: str, plan: Plan, mode: FakeTensorMode, device_of: Mapping[str, str]):
    """``name``'s pipeline class holding fake-weight models on ``device_of``'s devices, stand-in tokenizers and the
    published scheduler; in eval mode, as ``from_pretrained`` leaves a pipeline."""
    import diffusers

    found = entries()[name]
    parts: dict[str, Any] = {}
    for component, library, class_name in found.components():
        if component in found.configs:
            parts[component] = _fake_model(found, component, plan, mode, device_of.get(component, "cpu"))
        elif component == "scheduler":
            assert class_name is not None  # every catalog entry names its scheduler class
            parts[component] = _scheduler(class_name, found.scheduler_config)
        elif component.startswith("tokenizer"):
            parts[component] = tokenizer(found.tokenizer_max_length.get(component, 77))
        elif class_name in _VISION_PROCESSORS:
            parts[component] = _vision_processor(found)
        else:
            parts[component] = _other(library, class_name)
    cls = getattr(diffusers, found.pipeline_class)
    accepted = set(inspect.signature(cls.__init__).parameters)
    # the pipeline's own settings in model_index.json (SD 2.1's requires_safety_checker: false), as from_pretrained
    options = {k: v for k, v in found.model_index.items() if not k.startswith("_") and not isinstance(v, list)}
    pipe = cls(**{k: v for k, v in {**options, **parts}.items() if k in accepted})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _fake_model(found, component: str, plan: Plan, mode: FakeTensorMode, device: str) -> torch.nn.Module:
    from transformers import PreTrainedModel

    library, class_name = found.model_index[component]
    cls = model_class(library, class_name)
    # parameters on meta only: include_buffers=True would also put on meta the plain tensors a model computes at
    # init and keeps outside its buffers (Qwen-Image's rotary tables), which no fake then replaces
    with init_empty_weights(include_buffers=False), quiet_diffusers():
        if issubclass(cls, PreTrainedModel):
            module = cls._from_config(transformers_config(found.configs[component]))
        else:
            module = cls.from_config(found.configs[component])
    if hasattr(module, "tie_weights"):  # init_empty_weights unties tied weights (T5's shared embedding)
        module.tie_weights()
    dtype = _dtype(found, component, plan)
    keep = keep_in_fp32(library if library in ("diffusers", "transformers") else "diffusers", class_name, dtype)
    return standin.fill_fakes(module, mode, device, dtype, keep).eval()


def _dtype(found, component: str, plan: Plan) -> torch.dtype:
    # a plan made at the published dtype keeps each component's own (Wan's VAE: float32); another applies to all
    if plan.dtype is None or as_dtype(plan.dtype) == as_dtype(found.dtype):
        return component_dtype(found, component, None)
    return as_dtype(plan.dtype)


def _scheduler(class_name: str, config: dict):
    import diffusers

    return getattr(diffusers, class_name).from_config(config)


def _other(library: str | None, class_name: str | None):
    """A feature extractor or other processor, built with its defaults (its config changes no device memory)."""

    if library is None or class_name is None:  # an optional component left out ([null, null])
        return None
    try:
        return getattr(importlib.import_module(library), class_name)()
    except Exception:  # a component the pipeline can run without (as from_pretrained leaves a missing one)
        return None


@functools.cache
def _backend(special: tuple[tuple[str, int], ...] = ()):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({**_SPECIAL, **dict(special)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend


def tokenizer(max_length: int, special: tuple[tuple[str, int], ...] = ()):
    """A stand-in tokenizer: one token per word, padding, truncation and masks as transformers' tokenizers give
    them, ``model_max_length`` as published, a plain chat template; ``special``: (token, id) pairs it keeps whole
    (a vision-language encoder's image tokens, at the ids its config gives)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(_backend(special)), pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>", bos_token="<s>", model_max_length=max_length,
                                   additional_special_tokens=[token for token, _ in special], chat_template=_CHAT)


def _vision_processor(found) -> VisionProcessor:
    from transformers import Qwen2VLImageProcessorPil

    config = found.configs["text_encoder"]
    special = tuple((token, config[key]) for token, key in _VISION_TOKENS.items())
    return VisionProcessor(tokenizer(found.tokenizer_max_length.get("tokenizer", 77), special),
                           Qwen2VLImageProcessorPil(), "<|image_pad|>")


class VisionProcessor:
    """Qwen2-VL's processor as the edit pipelines call it: prompts holding ``<|image_pad|>`` and images in; token
    ids, mask, pixel values and patch grids out, each image's pad token repeated once per merged patch.

    The published image processor sizes the patches; the tokenizer is a stand-in. transformers' own
    ``Qwen2VLProcessor`` is not built: it requires a video processor, which requires torchvision.
    """

    def __init__(self, tokenizer, image_processor, image_token: str):
        self.tokenizer, self.image_processor, self.image_token = tokenizer, image_processor, image_token

    def __call__(self, text, images=None, padding=True, return_tensors="pt", **kwargs):
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        pixels = dict(self.image_processor(images=images, return_tensors=return_tensors)) if images else {}
        merged = self.image_processor.merge_size ** 2
        counts = iter(int(grid.prod()) // merged for grid in pixels.get("image_grid_thw", ()))
        texts = [re.sub(re.escape(self.image_token), lambda _: self.image_token * next(counts), t) for t in texts]
        ids = self.tokenizer(texts, padding=padding, return_tensors=return_tensors, **kwargs)
        return BatchFeature({**ids, **pixels})
