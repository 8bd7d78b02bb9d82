"""Every method's parameters are type-checked at construction, one line naming the parameter:
a float ``window`` must not surface later as an error inside a tensor op."""

import dataclasses

import pytest

import keepkv
from keepkv.methods import METHODS

WRONG = {  # a declared type -> values of other types that must be refused
    "int": [4.0, 3.5, True, "4", None],
    "float": [True, "0.5", None, float("nan")],
    "bool": [1, 0, "True", None],
    "str": [1, None, True],
}


def _typed_fields():
    for name, cls in sorted(METHODS.items()):
        for field in dataclasses.fields(cls):
            declared = field.type if isinstance(field.type, str) else field.type.__name__
            optional = declared.endswith(" | None")
            kind = declared.removesuffix(" | None")
            for value in WRONG.get(kind, []):
                if not (optional and value is None):
                    yield name, field.name, value


@pytest.mark.parametrize("method,param,value", list(_typed_fields()))
def test_a_parameter_of_the_wrong_type_is_refused_in_one_line(method, param, value):
    with pytest.raises(ValueError, match=param) as error:
        keepkv.get_method(method, **{param: value})
    assert "\n" not in str(error.value)


def test_snapkv_float_window_and_kernel():
    with pytest.raises(ValueError, match="snapkv: window must be an int, got 4.0"):
        keepkv.get_method("snapkv", window=4.0)
    with pytest.raises(ValueError, match="snapkv: kernel must be an int, got 3.0"):
        keepkv.get_method("snapkv+kernel=3.0")

