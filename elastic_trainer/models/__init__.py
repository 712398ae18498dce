"""Model seam: what a ``model.factory`` may return (:class:`ModelSpec`) and the built-in
factories. ``elastic_trainer.models.hf`` (Hugging Face causal LMs) needs the ``hf`` extra and
is imported only when configured."""

from .spec import BufferInitFn, InitFn, ModelSpec

__all__ = ["BufferInitFn", "InitFn", "ModelSpec"]
