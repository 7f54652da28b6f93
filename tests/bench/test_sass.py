"""bench/sass.py: reading a main loop's loads from SASS, and the kernels it compiles."""

import pytest

from bench import sass

# A loop of 8 instructions (0x0100-0x0170) with a guarded load, a 64-bit load, a load
# read only after the branch back (its reader wraps around), and an asynchronous copy.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0100*/               @P0 LDG.E R4, desc[UR4][R2.64] ;
        /*0110*/                   LDG.E.64 R6, desc[UR4][R8.64] ;
        /*0120*/                   LDGSTS.E.64 [R10], desc[UR4][R12.64] ;
        /*0130*/                   FMUL R20, R7, R20 ;
        /*0140*/                   LDS R14, [R16] ;
        /*0150*/                   FADD R4, R4, R21 ;
        /*0160*/                   STG.E desc[UR4][R2.64], R20 ;
        /*0170*/              @!P1 BRA 0x100 ;
        /*0180*/                   FADD R22, R14, R22 ;
        /*0190*/                   EXIT ;
"""


def test_main_loop_is_the_longest_backward_branch():
    loop = sass.main_loop(LISTING)
    assert len(loop) == 8
    assert loop[0].startswith("@P0 LDG.E R4") and loop[-1].startswith("@!P1 BRA")


def test_each_load_and_its_first_reader():
    loads = sass.loop_loads(sass.main_loop(LISTING))
    by_register = {load.text.split()[1].rstrip(","): load for load in loads}
    assert set(by_register) == {"R4", "R6", "R14"}  # the asynchronous copy is not a load
    assert by_register["R4"].reader_distance == 5  # the guard is not part of the text
    assert by_register["R4"].reader.startswith("FADD R4, R4")
    assert by_register["R6"].reader_distance == 2  # R7, the 64-bit load's upper half
    assert by_register["R14"].reader_distance is None  # read only after the loop


def test_no_loop_no_loads():
    assert sass.main_loop("        /*0000*/                   EXIT ;\n") == []


@pytest.mark.parametrize("batch", [False, True], ids=["shared-keys", "batch"])
def test_the_case_lowers_to_named_triton_kernels(batch):
    args = sass.argparse.Namespace(
        t=2, s=1024, heads=8, dim=32, top_k=16, dtype="fp8", batch=batch,
        page_size=64 if batch else 0,
    )  # fmt: skip
    modules = sass.triton_modules(*sass._case(args))
    names = [m["name"] for m in modules]
    assert names[0] == "jsparse_indexer_scores" and len(names) > 1
    # a second time in one process: the kernels are lowered again, not taken from a cache
    assert [m["name"] for m in sass.triton_modules(*sass._case(args))] == names
    for module in modules:
        assert f"@{module['name']}" in module["ir"]
        assert module["warps"] in (1, 2, 4, 8, 16) and module["stages"] >= 1
