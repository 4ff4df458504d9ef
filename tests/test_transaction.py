"""unimp.backend.transaction: the core's all-or-nothing apply, framework-free (the backends' snapshots are
tested against real models in each backend's test_apply_transaction.py)."""

import pytest

from unimp.backend.transaction import Snapshot, all_or_nothing


class Array:
    """Compares like an array: ``==`` gives no bool (a key or value must be matched by identity)."""

    def __eq__(self, other):
        raise TypeError("the truth value of an array is ambiguous")

    __hash__ = object.__hash__


class Layer:
    pass


def test_restores_attributes_containers_classes_and_values_in_the_same_objects():
    w, b = Array(), Array()
    layer, opt = Layer(), Layer()
    layer.params = {"w": w, "b": b}
    opt.groups = [{"params": [w, b], "lr": 0.1}]
    opt.state = {w: {"m": Array()}}
    value = {"v": w}
    params, groups, group_params, state = layer.params, opt.groups, opt.groups[0]["params"], opt.state
    snap = Snapshot([layer, opt], [(lambda: value["v"], lambda v: value.__setitem__("v", v))])

    class Wrapped(Layer):
        pass

    layer.params["w"] = Array()
    layer.forward = print
    layer.__class__ = Wrapped
    opt.groups[0]["params"][0] = Array()
    opt.groups.append({"params": []})
    opt.state[Array()] = {}
    del opt.state[w]
    value["v"] = Array()
    snap.restore()
    assert type(layer) is Layer and not hasattr(layer, "forward")
    assert layer.params is params and params["w"] is w and params["b"] is b
    assert opt.groups is groups and len(groups) == 1 and groups[0]["params"] is group_params
    assert group_params[0] is w and group_params[1] is b
    assert opt.state is state and list(state) == [w]
    assert value["v"] is w


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_all_or_nothing_restores_on_any_exception_and_reraises_it(error):
    layer = Layer()
    layer.x = 1

    def apply():
        layer.x = 2
        layer.y = 3
        raise error("half-way")

    with pytest.raises(error, match="half-way"):
        all_or_nothing(Snapshot([layer]), apply)
    assert vars(layer) == {"x": 1}
    assert all_or_nothing(Snapshot([layer]), lambda: "amp") == "amp"


def test_a_failing_restore_is_a_note_on_the_original_error():
    layer = Layer()

    def bad_put(v):
        raise OSError("cannot write back")

    def apply():
        layer.z = 1
        raise ValueError("the real error")

    with pytest.raises(ValueError, match="the real error") as info:
        all_or_nothing(Snapshot([layer], [(lambda: 0, bad_put)]), apply)
    assert "cannot write back" in " ".join(info.value.__notes__)
    assert not hasattr(layer, "z")  # the objects were restored although a value failed
