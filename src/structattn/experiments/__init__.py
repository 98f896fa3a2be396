"""Experiments on the shared engine: each brings its data, model, evaluation and report."""


def run_kind(values: dict) -> tuple[str, str]:
    """What kind of run a saved ``config.yaml`` (as a dict) describes, and the command that
    reads it: ``("a GL-Fusion node-classification run", "structattn glfusion predict")``."""
    data = values.get("data")
    if values.get("dataset") == "code-names":
        return "a code-names run", "structattn glfusion generate"
    if "dataset" in values:
        return "a GL-Fusion node-classification run", "structattn glfusion predict"
    if "samples" in values or (isinstance(data, dict) and "text_file" in data):
        return "a byte-level language-model run", "structattn lm --run-dir RUN --resume"
    if isinstance(data, dict) and "task" in data:
        return "an HKT/MHA sequence-classification run", "structattn eval"
    return "no run this library knows", "structattn --help"
