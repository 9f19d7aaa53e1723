"""Backend names are checked whole: "$" in a pattern also matched before a trailing newline."""

import pytest

from provisioning.backends.k8s_manifests import is_dns_label, is_label_value
from provisioning.backends.slurm_client import _check_name


@pytest.mark.parametrize("bad", ["alpha-1\n", "alpha 1", "alpha-1\nUsers=root", ""])
def test_slurm_names_refuse_a_trailing_newline_and_spaces(bad):
    with pytest.raises(ValueError):
        _check_name(bad, "name")


def test_kubernetes_labels_refuse_a_trailing_newline():
    assert is_dns_label("alpha") and not is_dns_label("alpha\n")
    assert is_label_value("alpha") and not is_label_value("alpha\n")
