"""Block-wise diffusion decoding: per-request parameters (`params`, each knob declared once: `knobs`),
the policy registry (`registry`), the policies' pure functions (`policies`, `sampling`) and what a
request's result carries (`types`). The engine that runs them: `engine.engine.Engine`. Importing the
package imports no torch."""

from engine.decoding.params import DecodeParamError, DecodeParams
from engine.decoding.types import GenerationResult, RequestStats

__all__ = ["DecodeParamError", "DecodeParams", "GenerationResult", "RequestStats"]
