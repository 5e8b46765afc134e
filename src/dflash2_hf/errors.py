"""Exceptions raised by dflash2-hf. Each message names what is wrong and how to fix it."""


class DFlash2Error(Exception):
    """Base class of the package's own errors."""


class DrafterTargetMismatchError(DFlash2Error, ValueError):
    """The drafter was built for another target (hidden size, vocabulary or layer count differ)."""


class TargetConfigError(DFlash2Error, ValueError):
    """The target's config lacks a size a drafter needs (under every name its architecture family uses)."""


class CheckpointError(DFlash2Error, OSError):
    """A drafter checkpoint is truncated, corrupt, or does not match its config."""


class UnsupportedTransformersVersionError(DFlash2Error, RuntimeError):
    """The installed transformers is outside the range whose generate() internals we tested."""


class UnsupportedGenerationError(DFlash2Error, ValueError):
    """A generate() setting the DFlash2 path cannot serve (e.g. batch size > 1, beam search)."""


class DrafterConfigError(DFlash2Error, ValueError):
    """A drafter setting out of range or of the wrong kind (a ``DFlash2Config`` value, a ``from_target`` override)."""


class DrafterArgumentTypeError(DFlash2Error, TypeError):
    """An argument of the wrong kind (e.g. a model id or a config where a loaded model belongs)."""


class FolderHoldsModelError(DFlash2Error, FileExistsError):
    """A save would put its files next to another model's in one folder (e.g. a LoRA adapter into a drafter folder),
    leaving a folder that loads as neither."""


class ShippedDrafterNotFoundError(DFlash2Error, FileNotFoundError):
    """A shipped drafter was named but its folder (the repository's ``model_cards/``) is not on this machine."""


class HubUnreachableError(DFlash2Error, OSError):
    """A Hub id was given (not a local folder, not in the local cache) while the Hub cannot be reached or
    ``HF_HUB_OFFLINE`` is set."""
