"""Downloads from the Hugging Face hub (cached; honours HF_HOME, HF_ENDPOINT and HF_HUB_OFFLINE), with
the hub's errors said as what to do about them."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse


def download(repo: str, filename: str, revision: str | None) -> Path:
    """`hf_hub_download`'s path of `filename` in `repo`; from the local cache alone where the hub's host does
    not resolve and no proxy would reach it (no network: the client would retry for about 25 s, logging each
    try, before failing the same way). Its errors are for `hub_errors` to word."""
    from huggingface_hub import constants, hf_hub_download

    url = urlparse(constants.ENDPOINT)
    host = url.hostname or ""
    proxied = url.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(host)
    offline = not (constants.HF_HUB_OFFLINE or proxied or _resolves(host))
    return Path(hf_hub_download(repo, filename, revision=revision, local_files_only=offline))


_RESOLVED: set[str] = set()  # hosts that had an address: a failure is asked again (a network not up yet)


def _resolves(host: str) -> bool:
    """Whether `host` has an address."""
    if host not in _RESOLVED:
        try:
            socket.getaddrinfo(host, 443)
        except (OSError, UnicodeError):
            return False
        _RESOLVED.add(host)
    return True


@contextmanager
def hub_errors(
    error: Callable[[str], Exception],
    repo: str,
    revision: str | None,
    *,
    missing: Callable[[Exception], str],
    offline: str,
    where: str = "",
    what: str | None = None,
) -> Iterator[None]:
    """Raise `error(message)` for a failed `hf_hub_download` inside the block: the hub unreachable with
    nothing cached (`offline`: what to give instead; `what` was to be downloaded, the repository by default),
    no such repository or revision, a file missing (`missing(e)` says which), a repo id or file name the hub
    client refuses to ask for (`nodir/..`, `a/b/../x`), or any other refusal. `where` prefixes each message
    (say, the SAE's spec)."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except LocalEntryNotFoundError:  # before EntryNotFoundError, which it subclasses
        raise error(
            f"{where}cannot reach the Hugging Face hub to download {what or repr(repo)}, and it is not in the local "
            f"cache; {offline}"
        ) from None
    except RepositoryNotFoundError:
        raise error(f"{where}no repository {repo!r} on the Hugging Face hub (or it is private)") from None
    except RevisionNotFoundError:
        raise error(f"{where}repository {repo!r} has no revision {revision!r}") from None
    except EntryNotFoundError as e:
        raise error(f"{where}{missing(e)}") from None
    except HfHubHTTPError as e:
        raise error(f"{where}the Hugging Face hub refused the download of {what or repr(repo)}: {e}") from None
    except HFValidationError as e:
        raise error(f"{where}not a local path, and not a valid hub repo id: {repo!r} ({_reason(e)})") from None
    except ValueError as e:
        if not _raised_by_hub_client(e):  # the block's own ValueErrors (a bad config.json, say) are not ours
            raise
        raise error(
            f"{where}not a local path, and not a valid path in the hub repository {repo!r}: {_reason(e)}"
        ) from None


def _raised_by_hub_client(e: BaseException) -> bool:
    """Whether `e` was raised inside huggingface_hub (its checks of file names are plain ValueErrors)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("huggingface_hub")


def _reason(e: Exception) -> str:
    """The hub client's message, on one line and without its advice to ask the repository's owner."""
    first = str(e).strip().split("\n")[0]
    return first.split(" Please ask the repository owner")[0].rstrip(".")
