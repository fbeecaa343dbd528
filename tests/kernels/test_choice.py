"""KernelChoice: the innermost choice wins, the previous one comes back on exit (also after an error)."""

import pytest

from mmdit_strict.kernels.choice import KernelChoice


def test_nested_choices_restore_and_unknown_names_are_refused() -> None:
    c = KernelChoice("demo variant", ("a", "b", "c"), "a")
    assert c.current() == "a"
    with c.use("b"):
        assert c.current() == "b"
        with pytest.raises(RuntimeError), c.use("c"):
            assert c.current() == "c"
            raise RuntimeError("inside")
        assert c.current() == "b"
    assert c.current() == "a"
    with pytest.raises(ValueError, match="demo variant must be one of"), c.use("d"):
        pass
    with pytest.raises(ValueError, match="default 'z'"):
        KernelChoice("demo variant", ("a",), "z")


def test_binding_the_choice_in_force_keeps_nesting_and_checks() -> None:
    """``use`` of the value already in force binds nothing, and what is bound inside it still unwinds in order."""
    c = KernelChoice("demo variant", ("a", "b"), "a")
    with c.use("a"):
        assert c.current() == "a"
        with c.use("b"):
            with c.use("b"):
                assert c.current() == "b"
            assert c.current() == "b"
        assert c.current() == "a"
    assert c.current() == "a"
    with c.use("b"), pytest.raises(ValueError, match="demo variant must be one of"), c.use("x"):
        pass
