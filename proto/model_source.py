"""Where a `--model` name points, read the same way by every service that opens the
checkpoint (the worker's weights, the gateway's tokenizer): a folder, or a Hugging Face Hub
id resolved through `huggingface_hub` and its local cache (`HF_HOME`).

A Hub id is looked up in the cache first, without the network; when it is not there, it
is downloaded (huggingface_hub's own progress bars go to stderr), unless `HF_HUB_OFFLINE`
is set or the Hub cannot be reached -- then a `ModelNotFound` says so, naming the cache.
Only what serving needs is fetched: configs, safetensors weights, tokenizer files and chat
templates (not `.bin`/`.pth` copies, nor Mistral's `consolidated.safetensors`).
"""

from pathlib import Path

ALLOW = ("*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt")
IGNORE = ("original/*", "consolidated*")


class ModelNotFound(FileNotFoundError):
    """The name is neither a checkpoint folder nor a Hub id this machine has or can fetch."""


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def resolve_model(name: str) -> Path:
    """The checkpoint folder `name` stands for (see the module docstring)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if looks_like_path(name):
        raise ModelNotFound(f"model {name!r}: no such folder")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=list(ALLOW), ignore_patterns=list(IGNORE),
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFound(f"model {name!r} is not a folder and not in {where}; HF_HUB_OFFLINE is "
                            f"set, so it was not downloaded")
    try:
        return Path(snapshot_download(name, allow_patterns=list(ALLOW), ignore_patterns=list(IGNORE)))
    except Exception as exc:  # noqa: BLE001 -- whatever the Hub said, the user needs it in one line
        raise ModelNotFound(f"model {name!r} is not a folder and not in {where}, and downloading it "
                            f"from {constants.ENDPOINT} failed: {type(exc).__name__}: {exc}") from exc


def served_names(name: str, served_model_name: str | None = None) -> list[str]:
    """Every name clients may use: those in `served_model_name` (comma-separated) when
    given; else a folder's basename, or the Hub id itself."""
    given = [n for n in (served_model_name or "").split(",") if n]
    if given:
        return given
    path = Path(name).expanduser()
    return [path.resolve().name if path.is_dir() or looks_like_path(name) else name]


def served_name(name: str, served_model_name: str | None = None) -> str:
    """The name responses report and workers register under: the first served name."""
    return served_names(name, served_model_name)[0]
