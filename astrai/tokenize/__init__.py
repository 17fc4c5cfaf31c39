"""astrai.tokenize: byte-level BPE tokenizer and Jinja2 chat templates."""

from astrai.tokenize.chat_template import ChatTemplate, default_template
from astrai.tokenize.stream import StreamDecoder
from astrai.tokenize.tokenizer import AutoTokenizer
from astrai.tokenize.training import SPECIAL_TOKENS

__all__ = ["AutoTokenizer", "ChatTemplate", "SPECIAL_TOKENS", "StreamDecoder", "default_template"]
