"""Provenance: the command as typed, never a machine's path; the code hash follows the imports."""

from lab.provenance import ROOT, Setup, code_hash, command, provenance, sources


def test_the_command_is_what_the_user_typed_whichever_way_the_lab_started():
    assert command(["/usr/local/bin/lab", "report", "--only", "overlap"]) == "lab report --only overlap"
    assert command(["/home/someone/src/lab/__main__.py", "report"]) == "lab report"
    assert command(["/opt/venv/bin/pytest", "-q"]) == "pytest -q"
    assert command(["/opt/venv/lib/python3.11/site-packages/pytest/__main__.py", "-q"]) == "python -m pytest -q"


def test_provenance_holds_no_path_of_this_machine():
    block = provenance(target="cpu:8", devices="8 x cpu", mesh="fsdp=8", module="lab.verdict")
    assert str(ROOT) not in block["command"] and block["code_hash"] == code_hash("lab.verdict")


def test_the_code_hash_covers_what_a_module_imports_transitively():
    found = sources("lab.verdict")
    assert found == {"lab.verdict"}  # it imports nothing of the lab
    found = sources("lab.registry")
    assert {"lab.registry", "lab.report", "lab.verdict", "lab.provenance", "lab.errors"} <= found
    assert code_hash("lab.registry") != code_hash("lab.report")


def test_setup_describes_devices():
    class Device:
        device_kind = "cpu"

    assert Setup.of("cpu:8", [Device()] * 8, "fsdp=8") == Setup("cpu:8", "8 x cpu", "fsdp=8")
