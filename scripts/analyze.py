"""gpt2-analyze: the residual stream of GPT-2 layer by layer, with and without residual connections.

    gpt2-analyze "The cat sat on the mat because" --model gpt2 --plot out.png
    gpt2-analyze "Hello" --model ./my-checkpoint --no-ablated --top-k 3

Per layer (-1: the embeddings entering block 0; L: the stream after block L) it prints the mean residual
norm, the effective rank of the token x d_model matrix, the rank-collapse measure ||X - 1x̄ᵀ|| / ||X||, the
mean cosine similarity between tokens, the mean attention entropy and the logit lens's top token at the
last position; then the same with every skip connection removed, side by side, where the collapse shows
(Dong, Cordonnier & Loukas 2021, "Attention is not all you need"). `--plot` draws norm, effective rank
and collapse across layers (needs matplotlib: `pip install matplotlib`, the project's `plot` extra).

    gpt2-analyze "The cat sat on the mat because" --model gpt2 --gradients --plot highway.png
    gpt2-analyze --attribution "The Eiffel Tower is in" "The Colosseum is in" --model gpt2 \
        --metric '{"type": "logit_diff", "tokens": [" Paris", " Rome"]}' --verify 5

`--gradients` adds the gradient highway (He et al. 2016): per layer, the norm of the language-model loss's
gradient at the residual stream, and per block the RMS gain of its Jacobian ∂resid_post/∂resid_pre against
the identity, with and without the skips. `--attribution CLEAN CORRUPT` scores every site (the residual
stream per layer and position, each head's hook_z, attn_out and mlp_out per layer) by attribution
patching for `--metric` (`loss`, or the HTTP API's metric as JSON), and with `--verify K` patches the top
K for real; `--plot` draws the scores as heatmaps.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python scripts/analyze.py`: started as `gpt2-analyze` is, which holds a Ctrl-C
    from gpt2_scripts.console import analyze  # during the imports below (this file is imported again there)

    analyze()

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from gpt2_scripts.console import empty_flag, takes_negative_values
from gpt2_scripts.generate import PromptError, read_prompt, replaces_an_input, saying_when_written, utf8_checked
from gpt2_scripts.json_flag import read_json_flag
from gpt2_scripts.sae_cli import add_sae_arguments, directions, features_table

from model.analysis import LayerStats, analyze
from model.dump import dump_path_problem, replace_whole
from model.generate import GenerationError, validate_prompt
from model.interventions import EditSpec, InterventionError
from model.lab.attribution import MAX_VERIFY, Attribution, attribution
from model.lab.gradients import LayerGradient, Loss, highway
from model.lab.sae import SAEError
from model.loading import LoadError, add_checkpoint_arguments, load_from
from model.tokenizer import InvalidTextError, Tokenizer

MAX_TOP_K = 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpt2-analyze", description="Measure GPT-2's residual stream layer by layer, with and without skips."
    )
    takes_negative_values(p)
    p.add_argument("prompt", nargs="?", help="the prompt (read from standard input when omitted or '-')")
    add_checkpoint_arguments(p)
    p.add_argument(
        "--top-k",
        type=int,
        help=f"the logit lens's most likely tokens at the last position, per layer, and with --sae each token's "
        f"top features (1..{MAX_TOP_K}, default 5)",
    )
    p.add_argument("--no-ablated", action="store_true", help="skip the run without residual connections")
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="write the figure here, in the format its extension names (.png, .svg, .pdf, ...): norm, effective "
        "rank and collapse across layers (and with --gradients the highway; with --attribution the heatmaps)",
    )
    add_sae_arguments(p, steer=False)
    p.add_argument(
        "--gradients", action="store_true", help="add the gradient highway: the loss's gradient, each block's Jacobian"
    )
    p.add_argument(
        "--attribution", nargs=2, metavar=("CLEAN", "CORRUPT"), help="attribution patching of CLEAN into CORRUPT"
    )
    p.add_argument("--metric", help="for --attribution: loss (the default), or the API's metric as JSON")
    p.add_argument("--verify", type=int, metavar="K", help="for --attribution: patch the top K for real (default 0)")
    args = p.parse_args(argv)
    if args.attribution:  # flags that the attribution run would not use: refused rather than ignored
        given = [
            flag
            for flag, value in (
                ("a prompt argument", args.prompt),
                ("--sae", args.sae),
                ("--gradients", args.gradients),
                ("--no-ablated", args.no_ablated),
                ("--top-k", args.top_k is not None),
            )
            if value
        ]
        if given:
            p.error(f"--attribution CLEAN CORRUPT does not take {', '.join(given)}")
        args.metric = "loss" if args.metric is None else args.metric
        args.verify = 0 if args.verify is None else args.verify
        if not 0 <= args.verify <= MAX_VERIFY:
            p.error(f"--verify must be in 0..{MAX_VERIFY}, got {args.verify}")
    else:
        for flag, value in (("--metric", args.metric), ("--verify", args.verify)):
            if value is not None:
                p.error(f"{flag} is for --attribution CLEAN CORRUPT")
        args.top_k = 5 if args.top_k is None else args.top_k
        if not 1 <= args.top_k <= MAX_TOP_K:
            p.error(f"--top-k must be in 1..{MAX_TOP_K}, got {args.top_k}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := empty_flag((("--model", args.model), ("--plot", args.plot))):
        return fail(problem)
    if sys.stdout is None:  # before the long part
        return fail("standard output is closed: nowhere to write the tables")
    plt = None
    if args.plot:
        try:
            plt = _pyplot()
        except ImportError:
            return fail(
                "--plot needs matplotlib, which is not installed: pip install matplotlib (the project's plot extra)"
            )
        formats = plt.FigureCanvasBase.get_supported_filetypes()
        if plot_format(args.plot) not in formats:  # else matplotlib would add .png
            return fail(
                f"--plot {args.plot}: the name must end in a format matplotlib writes ({', '.join(sorted(formats))})"
            )
        if plot_format(args.plot) == "pgf" and shutil.which(tex := plt.rcParams["pgf.texsystem"]) is None:
            return fail(f"--plot {args.plot}: matplotlib writes pgf with {tex}, which is not installed (LaTeX)")
        if problem := dump_path_problem(args.plot) or replaces_an_input(  # before the long part: a dump's rules
            "--plot", args.plot, args.model, args.tokenizer, args.sae
        ):
            return fail(problem)
    if args.attribution:
        return attribution_main(args, plt)
    try:
        prompt = read_prompt(args.prompt)
    except PromptError as e:
        return fail(str(e))
    try:
        loaded = load_from(args)
        ids = validate_prompt(loaded.model, loaded.tokenizer.encode(prompt), 0)
        saes = directions(args, loaded)
    except (LoadError, GenerationError, InvalidTextError, SAEError) as e:
        return fail(str(e))

    model, tok = loaded.model, loaded.tokenizer
    n_layer = model.config.n_layer
    everything = tuple(range(n_layer))
    no_skips = EditSpec((), everything, everything)
    if args.gradients and len(ids) < 2:
        return fail("--gradients needs a prompt of at least 2 tokens (the loss predicts the second)")
    ablated = None
    grads: tuple[list[LayerGradient], list[LayerGradient] | None] | None = None
    try:  # a run whose activations or loss are not finite (float16 overflowing, say) is one line, not a traceback
        normal = analyze(model, ids, args.top_k)
        if not args.no_ablated:
            ablated = analyze(model, ids, args.top_k, no_skips.hooks(model.config, len(ids)))
        if args.gradients:
            grads = highway(model, ids), None if args.no_ablated else highway(model, ids, no_skips)
    except InterventionError as e:
        return fail(str(e))

    tables = [f"{loaded.name}: {len(ids)} tokens; layer -1 is the embeddings, layer L the stream after block L"]
    tables.append(table(normal, ablated, tok))
    tables += ["", lens_table(normal, tok, "with residual connections")]
    if ablated is not None:
        tables += ["", lens_table(ablated, tok, "without residual connections")]
    for sae_id, sae in saes.saes.items():  # --sae: each SAE's features per token
        tables += ["", features_table(sae_id, sae, loaded, ids, args.top_k)]
    if grads is not None:
        tables += ["", highway_table(*grads)]
    if failure := write_out(tables):
        return fail(failure)
    if plt is not None:
        try:
            with saying_when_written(args.plot, f"wrote {args.plot}"):
                plot(plt, args.plot, normal, ablated, f"{loaded.name}: {prompt!r}", grads)
        except OSError as e:
            return fail(f"cannot write {args.plot}: {e.strerror or e}")
        except RuntimeError as e:  # a format whose tool is missing (pgf needs LaTeX)
            return fail(f"cannot write {args.plot}: {e}")
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
    token = _token(tok, s.logit_lens[-1][0][0])
    cosine = _shown(s.mean_cosine, 3)
    return f"{norm:9.2f} {s.effective_rank:8.2f} {s.collapse:8.4f} {cosine:8.3f} {entropy}  {token:<14}"


def _token(tok: Tokenizer, token_id: int) -> str:
    token = repr(tok.token_name(token_id))  # a piece of a character by its bytes, not as U+FFFD
    return token if len(token) <= 14 else token[:13] + "…"


def _shown(value: float, digits: int) -> float:
    """`value`, but 0 where it rounds to 0 at `digits`: no -0.000 for a value that is 0 up to float noise."""
    value = float(value)  # a 0-d tensor too (attribution's per-block scores)
    return value if round(value, digits) else 0.0


def lens_table(run: list[LayerStats], tok: Tokenizer, which: str) -> str:
    """The logit lens at the last position: each layer's stream through the final LayerNorm and the
    unembedding, its `--top-k` most likely next tokens with their probabilities."""
    lines = [f"logit lens at the last position, {which} (token probability, most likely first):"]
    for s in run:
        lines.append(f"{s.layer:>5}  " + "  ".join(f"{_token(tok, t)} {p:.3f}" for t, p in s.logit_lens[-1]))
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot(
    plt: Any,
    path: str,
    normal: list[LayerStats],
    ablated: list[LayerStats] | None,
    title: str,
    grads: tuple[list[LayerGradient], list[LayerGradient] | None] | None = None,
) -> None:
    """Norm, effective rank and collapse across layers, with (and without) residual connections; with
    `grads`, a second row: the loss's gradient norm per layer and each block's Jacobian RMS gain."""
    from matplotlib.ticker import MaxNLocator

    measures = [
        ("mean residual norm", lambda s: sum(s.norms) / len(s.norms)),
        ("effective rank", lambda s: s.effective_rank),
        ("rank collapse ‖X − 1x̄ᵀ‖ / ‖X‖", lambda s: s.collapse),
    ]
    fig, grid = plt.subplots(2 if grads else 1, len(measures), figsize=(15, 8.4 if grads else 4.2), squeeze=False)
    axes = grid[0]
    if grads is not None:
        _plot_highway(grid[1], *grads)
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
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole layers (49 ticks would crowd gpt2-xl's)
    fig.suptitle(title if len(title) <= 100 else title[:99] + "…", parse_math=False)  # the prompt as it is, $ too
    fig.tight_layout()
    save_figure(plt, fig, path)


_GRAD_COLUMNS = f"{'grad_norm':>10} {'jac_rms':>8} {'|J-I|_rms':>9}"


def highway_table(normal: list[LayerGradient], ablated: list[LayerGradient] | None) -> str:
    """The gradient highway, one row per layer: ‖∂loss/∂x‖ at the stream (mean over positions), and the
    block's Jacobian ‖J‖_F/√n and ‖J - I‖_F/√n (1 and 0 for the identity); with and without the skips."""
    titles = ("gradient, with residual connections", "without residual connections")
    width = max(len(_GRAD_COLUMNS), *(len(t) for t in titles))  # each side's cells padded to its title
    rows = [f"{'':5} {titles[0]:^{width}}", f"{'layer':>5} {_GRAD_COLUMNS:<{width}}"]
    if ablated is not None:
        rows[0] += f" | {titles[1]:^{width}}"
        rows[1] += f" | {_GRAD_COLUMNS}"
    for i, g in enumerate(normal):
        row = f"{g.layer:>5} {_grad_cells(g):<{width}}"
        if ablated is not None:
            row += f" | {_grad_cells(ablated[i])}"
        rows.append(row)
    ratio = f"first / last layer gradient norm: {_ratio(normal)} with the skips"
    if ablated is not None:
        ratio += f", {_ratio(ablated)} without"
    return "\n".join([*(row.rstrip() for row in rows), ratio])


def _ratio(run: list[LayerGradient]) -> str:
    """The first layer's gradient norm over the last's ("inf" or "nan" where the last is 0)."""
    first, last = run[0].grad_norm, run[-1].grad_norm
    return f"{first / last:.3g}" if last else ("nan" if not first else "inf")


def _grad_cells(g: LayerGradient) -> str:
    if g.jacobian_norm is None or g.jacobian_identity_distance is None:
        return f"{g.grad_norm:10.3e} {'-':>8} {'-':>9}"
    return f"{g.grad_norm:10.3e} {g.jacobian_norm:8.3f} {g.jacobian_identity_distance:9.3f}"


def _plot_highway(axes: Any, normal: list[LayerGradient], ablated: list[LayerGradient] | None) -> None:
    from matplotlib.ticker import MaxNLocator

    series = [("with residual connections", "o-", normal), ("without residual connections", "s--", ablated)]
    for label, style, run in series:
        if run is None:
            continue
        axes[0].plot([g.layer for g in run], [g.grad_norm for g in run], style, label=label)
        inner = [g for g in run if g.jacobian_norm is not None]
        axes[1].plot([g.layer for g in inner], [g.jacobian_norm for g in inner], style, label=label)
        axes[2].plot([g.layer for g in inner], [g.jacobian_identity_distance for g in inner], style, label=label)
    axes[0].set_yscale("log")
    axes[0].set_title("‖∂loss/∂x‖ at the stream (mean over positions)")
    axes[1].axhline(1.0, color="grey", lw=1, ls=":", label="the identity")
    axes[1].set_title("block Jacobian RMS gain ‖J‖_F / √n")
    axes[2].set_title("distance from the identity ‖J - I‖_F / √n")
    for ax in axes:
        ax.set_xlabel("layer (-1: embeddings)" if ax is axes[0] else "block")
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend()
    axes[1].legend()


def attribution_main(args: argparse.Namespace, plt: Any) -> int:
    """gpt2-analyze --attribution CLEAN CORRUPT: the scores as tables (and heatmaps with --plot)."""
    try:
        spec = read_metric(args.metric)  # before the model loads
        texts = [
            utf8_checked(p, f"the {which} prompt")
            for p, which in zip(args.attribution, ("clean", "corrupted"), strict=True)
        ]
    except (GenerationError, PromptError) as e:
        return fail(str(e))
    try:
        loaded = load_from(args)
        tok = loaded.tokenizer
        clean, corrupt = (validate_prompt(loaded.model, tok.encode(p), 0) for p in texts)
        metric = Loss() if spec is None else spec.metric(tok)
        result = attribution(loaded.model, clean, corrupt, metric, args.verify)
    except (GenerationError, InterventionError) as e:  # the metric's are named so: its token, its position
        return fail(f"--metric: {e}" if (getattr(e, "param", None) or "").startswith("metric") else str(e))
    except (LoadError, InvalidTextError) as e:
        return fail(str(e))
    tables = [f"{loaded.name}: {len(clean)} tokens; metric {args.metric}"]
    tables.append(attribution_table(result, [tok.token_name(t) for t in clean], [tok.token_name(t) for t in corrupt]))
    if failure := write_out(tables):
        return fail(failure)
    if plt is not None:
        try:
            with saying_when_written(args.plot, f"wrote {args.plot}"):
                plot_attribution(plt, args.plot, result, [tok.token_name(t) for t in clean])
        except (OSError, RuntimeError) as e:
            return fail(f"cannot write {args.plot}: {getattr(e, 'strerror', None) or e}")
    return 0


METRICS = (
    '{"type": "logprob", "token": ..., "position": -1}, {"type": "logit_diff", "tokens": [a, b]}, {"type": "loss"}'
)


def read_metric(text: str) -> Any:
    """`loss` (None), or the metric as the HTTP API takes it (JSON: a `MetricSpec`, whose `metric(tokenizer)`
    turns token texts into ids)."""
    if text.strip() == "loss":
        return None
    from pydantic import TypeAdapter

    from server.schemas import MetricSpec

    adapter: TypeAdapter[Any] = TypeAdapter(MetricSpec)
    try:
        return read_json_flag("--metric", text, adapter.validate_python, GenerationError)
    except GenerationError as e:
        if text.lstrip().startswith("{"):
            raise
        raise GenerationError(f"{e}; give loss, or a metric as JSON: {METRICS}") from None


def attribution_table(result: Attribution, clean: list[str], corrupt: list[str]) -> str:
    """The residual stream's scores (layer x position), each head's, attn_out's and mlp_out's, and the
    patched sites: each estimate beside the real change."""
    lines = [
        f"metric: clean {_shown(result.clean_metric, 4):.4f}, corrupted {_shown(result.corrupted_metric, 4):.4f} "
        f"(patching everything would change it by {_shown(result.clean_metric - result.corrupted_metric, 4):+.4f})",
        "",
        "attribution at blocks.L.hook_resid_pre, per position (clean token / corrupted token):",
    ]
    labels = [repr(a) if a == b else f"{a!r}/{b!r}" for a, b in zip(clean, corrupt, strict=True)]
    width = max(9, *(min(len(s), 18) for s in labels))
    lines.append(f"{'layer':>5} " + " ".join(f"{s[:18]:>{width}}" for s in labels))
    for i, row in enumerate(result.resid_pre.tolist()):
        lines.append(f"{i:>5} " + " ".join(f"{_shown(v, 4):>{width}.4f}" for v in row))
    H = result.z.shape[1]
    lines += ["", "attribution at blocks.L.attn.hook_z, per head (every position):"]
    lines.append(f"{'layer':>5} " + " ".join(f"{'head ' + str(h):>9}" for h in range(H)))
    lines += [f"{i:>5} " + " ".join(f"{_shown(v, 4):9.4f}" for v in row) for i, row in enumerate(result.z.tolist())]
    lines += ["", f"{'layer':>5} {'attn_out':>9} {'mlp_out':>9}"]
    pairs = zip(result.attn_out, result.mlp_out, strict=True)
    lines += [f"{i:>5} {_shown(a, 4):9.4f} {_shown(m, 4):9.4f}" for i, (a, m) in enumerate(pairs)]
    if result.verified:
        lines += ["", f"{'patched for real (the `set` edit)':<44} {'estimate':>9} {'change':>9}"]
        for v in result.verified:
            s = v.site
            where = s.hook + (f" @ position {s.position}" if s.position is not None else "")
            where += f" head {s.head}" if s.head is not None else ""
            lines.append(f"{where:<44} {_shown(v.attribution, 4):9.4f} {_shown(v.patched_change, 4):9.4f}")
    return "\n".join(lines)


def plot_attribution(plt: Any, path: str, result: Attribution, tokens: list[str]) -> None:
    """Heatmaps of the residual stream's scores (layer x position) and each head's (layer x head)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [max(3, len(tokens)), 4]})
    for ax, scores, xlabel, ticks in (
        (left, result.resid_pre, "position", [repr(t) for t in tokens]),
        (right, result.z, "head", [str(h) for h in range(result.z.shape[1])]),
    ):
        bound = float(scores.abs().max()) or 1.0
        image = ax.imshow(scores.numpy(), cmap="RdBu", vmin=-bound, vmax=bound, aspect="auto")
        rotation = 60 if xlabel == "position" else 0
        ax.set_xticks(range(len(ticks)), ticks, rotation=rotation, fontsize=8, parse_math=False)  # tokens as they are
        ax.set_xlabel(xlabel)
        ax.set_ylabel("layer")
        ax.set_yticks(range(scores.shape[0]))
        fig.colorbar(image, ax=ax)
    left.set_title("attribution at hook_resid_pre")
    right.set_title("attribution at attn.hook_z (every position)")
    fig.tight_layout()
    save_figure(plt, fig, path)


def write_out(lines: list[str]) -> str | None:
    """Print `lines` to standard output; why they could not be written (a full disk), or None. A reader gone
    (`| head`) is left to `run_console`, which ends the process as `cat` ends."""
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:  # a full disk (`> /dev/full`), say
        return f"cannot write the tables: {e.strerror or e}"
    return None


def save_figure(plt: Any, fig: Any, path: str) -> None:
    """Write `fig` to `path` whole (a temporary file renamed over it: a full disk leaves the old file), in the
    format `path`'s extension names (the temporary's is the file's a link at `path` points to), then let it go."""
    kind = plot_format(path)
    try:
        replace_whole(path, lambda temporary: fig.savefig(temporary, dpi=110, format=kind))
    finally:
        plt.close(fig)


def plot_format(path: str) -> str:
    """The format a plot's file name asks matplotlib for: its extension, lowercased ("svg" for `fig.SVG`)."""
    return Path(path).suffix.removeprefix(".").lower()


def fail(message: str) -> int:
    print(f"gpt2-analyze: error: {message}", file=sys.stderr)
    return 1
