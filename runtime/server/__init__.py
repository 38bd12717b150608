"""``expertfs serve``: an OpenAI-compatible HTTP server over one ``Engine``.

``schema`` validates requests into typed values (a bad request is a 4xx JSON error, never a
crash), ``session`` runs one generation at a time on the engine with prompt-prefix reuse,
``queue`` bounds how many requests wait, ``app`` is the aiohttp application; ``tools`` (and
``harmony``) parse tool calls as they stream, ``grammar`` constrains decoding (``response_format``
JSON, forced tool calls) through llguidance.
"""

from .app import ServerConfig, build_app
from .schema import CompletionRequest, RequestError

__all__ = ["ServerConfig", "build_app", "CompletionRequest", "RequestError"]
