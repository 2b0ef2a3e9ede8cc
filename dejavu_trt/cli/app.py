"""The typer application every stage's command module registers on."""
import typer

app = typer.Typer(
    name="dejavu-trt",
    help="DejaVu contextual sparsity for LLM decoding: calibrate, train lookahead predictors, export and "
         "rewrite ONNX graphs into sparse plugin nodes, build engines and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Shared help texts, so every command that takes these says the same thing.
SPARSITY_HELP = ("Fraction of MLP neurons kept active per token, in (0, 1] — the paper's S_mlp "
                 "(0.25 keeps a quarter of the neurons; 1.0 is dense).")
HEAD_SPARSITY_HELP = "Fraction of attention heads kept active per token, in (0, 1] (1.0 keeps every head)."
MAX_PPL_HELP = ("Instead of one global --sparsity, pick per-layer kept fractions that keep validation "
                "perplexity within this relative increase over dense (0.05 = +5%) while moving the fewest bytes.")
