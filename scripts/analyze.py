"""gpt2-analyze: the residual stream of GPT-2 layer by layer, with and without residual connections.

    gpt2-analyze "The cat sat on the mat because" --model gpt2 --plot out.png
    gpt2-analyze "Hello" --model ./my-checkpoint --no-ablated --top-k 3

Per layer (-1: the embeddings entering block 0; L: the stream after block L) it prints the mean residual
norm, the effective rank of the token x d_model matrix, the rank-collapse measure ||X - 1x̄ᵀ|| / ||X||, the
mean cosine similarity between tokens, the mean attention entropy and the logit lens's top token at the
last position; then the same with every skip connection removed, side by side, where the collapse shows
(Dong, Cordonnier & Loukas 2021, "Attention is not all you need"). `--plot` draws norm, effective rank
and collapse across layers (needs matplotlib: `pip install 'gpt2-server[plot]'`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gpt2_scripts.sae_cli import add_sae_arguments, directions, features_table

from model.analysis import LayerStats, analyze
from model.generate import GenerationError, validate_prompt
from model.interventions import EditSpec
from model.lab.sae import SAEError
from model.loading import LoadError, add_checkpoint_arguments, load_from
from model.tokenizer import InvalidTextError, Tokenizer

MAX_TOP_K = 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpt2-analyze", description="Measure GPT-2's residual stream layer by layer, with and without skips."
    )
    p.add_argument("prompt", nargs="?", help="the prompt (read from standard input when omitted or '-')")
    add_checkpoint_arguments(p)
    p.add_argument("--top-k", type=int, default=5, help=f"logit-lens tokens per position (1..{MAX_TOP_K})")
    p.add_argument("--no-ablated", action="store_true", help="skip the run without residual connections")
    p.add_argument("--plot", metavar="PNG", help="write norm, effective rank and collapse across layers here")
    add_sae_arguments(p, steer=False)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 1 <= args.top_k <= MAX_TOP_K:
        return fail(f"--top-k must be in 1..{MAX_TOP_K}, got {args.top_k}")
    plt = None
    if args.plot:
        try:
            plt = _pyplot()
        except ImportError:
            return fail("--plot needs matplotlib, which is not installed: pip install 'gpt2-server[plot]'")
        formats = plt.FigureCanvasBase.get_supported_filetypes()
        if Path(args.plot).suffix.removeprefix(".").lower() not in formats:  # else matplotlib would add .png
            return fail(
                f"--plot {args.plot}: the name must end in a format matplotlib writes ({', '.join(sorted(formats))})"
            )
    prompt = sys.stdin.read() if args.prompt in (None, "-") else args.prompt
    try:
        loaded = load_from(args)
        ids = validate_prompt(loaded.model, loaded.tokenizer.encode(prompt), 0)
        saes = directions(args, loaded)
    except (LoadError, GenerationError, InvalidTextError, SAEError) as e:
        return fail(str(e))

    model, tok = loaded.model, loaded.tokenizer
    n_layer = model.config.n_layer
    normal = analyze(model, ids, args.top_k)
    ablated = None
    if not args.no_ablated:
        everything = tuple(range(n_layer))
        ablated = analyze(model, ids, args.top_k, EditSpec((), everything, everything).hooks(model.config, len(ids)))

    print(f"{loaded.name}: {len(ids)} tokens; layer -1 is the embeddings, layer L the stream after block L")
    print(table(normal, ablated, tok))
    for sae_id, sae in saes.saes.items():  # --sae: each SAE's features per token
        print()
        print(features_table(sae_id, sae, loaded, ids, args.top_k))
    if plt is not None:
        try:
            plot(plt, args.plot, normal, ablated, f"{loaded.name}: {prompt!r}")
        except OSError as e:
            return fail(f"cannot write {args.plot}: {e.strerror or e}")
        except RuntimeError as e:  # a format whose tool is missing (pgf needs LaTeX)
            return fail(f"cannot write {args.plot}: {e}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


_COLUMNS = f"{'norm':>9} {'eff_rank':>8} {'collapse':>8} {'mean_cos':>8} {'attn_ent':>8}  {'lens@last':<14}"


def table(normal: list[LayerStats], ablated: list[LayerStats] | None, tok: Tokenizer) -> str:
    """One row per layer: the measures with residual connections, then (if given) without, side by side."""
    width = len(_COLUMNS)
    header = f"{'':5} {'with residual connections':^{width}}"
    columns = f"{'layer':>5} {_COLUMNS}"
    if ablated is not None:
        header += f" | {'without residual connections':^{width}}"
        columns += f" | {_COLUMNS}"
    rows = [header, columns]
    for i, s in enumerate(normal):
        row = f"{s.layer:>5} {_cells(s, tok)}"
        if ablated is not None:
            row += f" | {_cells(ablated[i], tok)}"
        rows.append(row)
    return "\n".join(row.rstrip() for row in rows)


def _cells(s: LayerStats, tok: Tokenizer) -> str:
    norm = sum(s.norms) / len(s.norms)
    entropy = f"{sum(s.attention_entropy) / len(s.attention_entropy):8.3f}" if s.attention_entropy else f"{'-':>8}"
    token = repr(tok.token_text(s.logit_lens[-1][0][0]))
    token = token if len(token) <= 14 else token[:13] + "…"
    return f"{norm:9.2f} {s.effective_rank:8.2f} {s.collapse:8.4f} {s.mean_cosine:8.3f} {entropy}  {token:<14}"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot(plt: Any, path: str, normal: list[LayerStats], ablated: list[LayerStats] | None, title: str) -> None:
    """Norm, effective rank and collapse across layers, with (and without) residual connections."""
    measures = [
        ("mean residual norm", lambda s: sum(s.norms) / len(s.norms)),
        ("effective rank", lambda s: s.effective_rank),
        ("rank collapse ‖X − 1x̄ᵀ‖ / ‖X‖", lambda s: s.collapse),
    ]
    fig, axes = plt.subplots(1, len(measures), figsize=(15, 4.2))
    layers = [s.layer for s in normal]
    for ax, (name, value) in zip(axes, measures, strict=True):
        ax.plot(layers, [value(s) for s in normal], "o-", label="with residual connections")
        if ablated is not None:
            ax.plot(layers, [value(s) for s in ablated], "s--", label="without residual connections")
        ax.set_title(name)
        ax.set_xlabel("layer (-1: embeddings)")
        ax.grid(alpha=0.3)
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    axes[0].legend()
    fig.suptitle(title if len(title) <= 100 else title[:99] + "…")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def fail(message: str) -> int:
    print(f"gpt2-analyze: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
