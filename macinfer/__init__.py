"""macinfer: a local LLM inference engine for Apple silicon, built on MLX."""

from macinfer._blas import load_openblas

load_openblas()  # NOTE: must happen before anything imports mlx.

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import macinfer` (and the CLI's --help) stays fast.
    if name == "LLM":
        from macinfer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from macinfer.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
