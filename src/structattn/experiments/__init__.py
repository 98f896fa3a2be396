"""Experiments on the shared engine: each brings its data, model, evaluation and report."""

#: Kinds of run: what each is called and the command that reads it.
RUN_KINDS = {
    "code-names": ("a code-names run", "structattn code-names generate"),
    "glfusion": ("a GL-Fusion node-classification run", "structattn glfusion predict"),
    "lm": ("a byte-level language-model run", "structattn lm --run-dir RUN --resume"),
    "lra": ("an HKT/MHA sequence-classification run", "structattn eval"),
    "unknown": ("no run this library knows", "structattn --help"),
}


def run_kind(values: dict) -> str:
    """The key in :data:`RUN_KINDS` of the run a saved ``config.yaml`` (as a dict) describes."""
    data = values.get("data")
    if values.get("dataset") == "code-names":
        return "code-names"
    if "dataset" in values:
        return "glfusion"
    if "samples" in values or (isinstance(data, dict) and "text_file" in data):
        return "lm"
    if isinstance(data, dict) and "task" in data:
        return "lra"
    return "unknown"


def check_run_kind(run_dir, values: dict, expected: str, wanted: str) -> None:
    """A RunError naming the kind of run ``values`` describe and its command, unless it is
    ``expected`` (``wanted`` says what the caller reads)."""
    from structattn.errors import RunError

    kind = run_kind(values)
    if kind != expected:
        what, command = RUN_KINDS[kind]
        raise RunError(f"{run_dir} holds {what}, not {wanted}: see `{command}`")
