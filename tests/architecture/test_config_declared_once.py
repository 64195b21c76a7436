"""ZeroConfig's fields are declared once, in ``ds_strategy/config/``, and read from files in one place.

Each field's default, check, meaning, section (and so its policy) live in its ``setting(...)`` declaration; the
policies, Hydra's groups, the autotuner's search and the DeepSpeed writer are derived from those declarations and
from the DeepSpeed key tables. A list of field names written out elsewhere is a second grouping that drifts from the
first (a loss-scaling field missing from Hydra's precision group, a DeepSpeed key the hand-kept writer forgot), and a
second reader of configuration files is a second set of rules for what a file may hold. Read from the sources with
``ast``.
"""

import ast
import dataclasses
from pathlib import Path

import ds_strategy
from ds_strategy.config import ZeroConfig

ROOT = Path(ds_strategy.__file__).parent
FIELDS = {field.name for field in dataclasses.fields(ZeroConfig)}
# Files allowed a list of names that happen to be fields' names, with why.
NOT_A_GROUPING = {
    "cli/estimate.py": "the columns of an estimate row, which carry the names of the fields they were estimated for",
    "estimate.py": "an estimate reports the settings it was made for, under the fields' names",
}
# Files allowed to parse YAML or JSON text outside config/sources.py, with why.
NOT_A_CONFIG_FILE = {
    "cli/autotune.py": "parses a --try value from the command line as YAML scalars; no file",
    "checkpoint/manifest.py": "a checkpoint's manifest, data the checkpoint wrote",
    "checkpoint/pretrained.py": "a Hugging Face checkpoint's index of weight files",
    "checkpoint/hf_export.py": "a Hugging Face model's own config.json beside the weights it exports",
}


def _sources(exclude: str = "config") -> list[Path]:
    return [path for path in sorted(ROOT.rglob("*.py")) if path.relative_to(ROOT).parts[0] != exclude]


def _field_name_lists(path: Path) -> list[str]:
    """Tuples, lists and sets of three or more field names, and classes declaring three or more (a dict is a table
    of values, which a grouping is not)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in FIELDS]
            if len(names) >= 3:
                found.append(f"line {node.lineno}: {names}")
        elif isinstance(node, ast.ClassDef):
            names = [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id in FIELDS
            ]
            if len(names) >= 3:
                found.append(f"class {node.name}: {names}")
    return found


def test_no_field_names_are_listed_outside_the_config_package():
    offenders = {}
    for path in _sources():
        where = str(path.relative_to(ROOT))
        if where not in NOT_A_GROUPING and (lists := _field_name_lists(path)):
            offenders[where] = lists
    assert offenders == {}, (
        "derive the grouping from ZeroConfig's declarations (ds_strategy.config.zero_config.fields_of, a Section, "
        "setting(acts_at=..., bounds_elements=...)) or the DeepSpeed key tables instead of listing field names"
    )


def test_the_policies_list_no_fields_of_their_own():
    """A policy's fields are those of its sections (``declare_policy_fields``), not a class body re-listing them."""
    assert _field_name_lists(ROOT / "config" / "policies.py") == []


def test_the_detector_finds_a_hand_kept_list(tmp_path):
    """The rule can fail: the Hydra precision group and the autotuner's list as they were written before."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        'PRECISION_FIELDS = ("precision", "loss_scale", "hysteresis")\n'
        "class Policy:\n    stage: int\n    overlap_comm: bool\n    timeout: float\n"
    )
    assert len(_field_name_lists(sample)) == 2


def _parses_yaml_or_json(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in {
                ("json", "load"),
                ("json", "loads"),
                ("yaml", "safe_load"),
                ("yaml", "load"),
                ("yaml", "full_load"),
            }:
                return True
    return False


def test_only_sources_reads_configuration_files():
    """``ds_strategy.config.sources.load_config`` is the one reader: the DeepSpeed translation takes mappings, and
    ``ds-strategy launch`` hands its accelerate YAML (and a ``deepspeed_config_file``) to ``load_config``."""
    readers = sorted(str(path.relative_to(ROOT)) for path in _sources(exclude="") if _parses_yaml_or_json(path))
    assert set(readers) - set(NOT_A_CONFIG_FILE) == {"config/sources.py"}
