import nbformat

from attnum import runner


def test_committed_notebooks_have_no_outputs_and_a_parameters_cell_first():
    for study, path in runner.studies().items():
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert "parameters" in code[0].metadata.get("tags", []), f"{path.name}: first code cell must be tagged"
        for cell in code:
            assert not cell.outputs and cell.execution_count is None, f"{path.name} carries outputs"
        assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
        first_md = next(c for c in nb.cells if c.cell_type == "markdown")
        assert first_md.source.startswith("# "), f"{path.name} must open with a title"


def test_parameters_cell_only_declares_values():
    """Derived values belong in a later cell: papermill does not recompute the parameters cell."""
    for path in runner.studies().values():
        nb = nbformat.read(path, as_version=4)
        cell = next(c for c in nb.cells if c.cell_type == "code")
        for line in cell.source.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                assert ":" in line.split("=")[0] and "#" in line, f"{path.name}: {line!r} is not 'name: type = value  # help'"
