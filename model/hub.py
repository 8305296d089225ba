"""Downloads from the Hugging Face hub (cached; honours HF_HOME, HF_ENDPOINT and HF_HUB_OFFLINE), with
the hub's errors said as what to do about them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def hub_errors(
    error: Callable[[str], Exception],
    repo: str,
    revision: str | None,
    *,
    missing: Callable[[Exception], str],
    offline: str,
    where: str = "",
) -> Iterator[None]:
    """Raise `error(message)` for a failed `hf_hub_download` inside the block: the hub unreachable with
    nothing cached (`offline`: what to give instead), no such repository or revision, a file missing
    (`missing(e)` says which), or any other refusal. `where` prefixes each message (say, the SAE's spec)."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except LocalEntryNotFoundError:  # before EntryNotFoundError, which it subclasses
        raise error(
            f"{where}cannot reach the Hugging Face hub to download {repo!r}, and it is not in the local cache; "
            f"{offline}"
        ) from None
    except RepositoryNotFoundError:
        raise error(f"{where}no repository {repo!r} on the Hugging Face hub (or it is private)") from None
    except RevisionNotFoundError:
        raise error(f"{where}repository {repo!r} has no revision {revision!r}") from None
    except EntryNotFoundError as e:
        raise error(f"{where}{missing(e)}") from None
    except HfHubHTTPError as e:
        raise error(f"{where}the Hugging Face hub refused the download of {repo!r}: {e}") from None
