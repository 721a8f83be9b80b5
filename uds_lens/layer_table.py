"""The long ``layers`` table's site policy: which rows a figure or an analysis reads when results of several
``--site`` runs are stacked ([`one_site`][uds_lens.layer_table.one_site]). Pandas and the config only, so results, analyses and figures share it
without importing each other."""

from __future__ import annotations

import pandas as pd

from uds_lens.config import UDSConfig

DEFAULT_SITE: str = UDSConfig.site
"""The site a multi-site ``layers`` table is read at when none is named: ``UDSConfig``'s default."""


def one_site(layers: pd.DataFrame, site: str | None = None) -> pd.DataFrame:
    """The rows of one patching site of a long ``layers`` table: the one policy of every analysis and figure.

    A table holds several sites when results of several ``--site`` runs are stacked. Then:

    * ``site`` given: its rows (``ValueError`` naming the sites there when the table has none of it);
    * no ``site``: a table of one site, or without a ``site`` column, as it is; of several, the rows of the default
      site (``UDSConfig.site``, ``resid_post``: the site ``uds-lens score`` patches without ``--site``), and
      ``ValueError`` asking for ``site=`` when that site is not among them (no silent pick of an arbitrary one).
    """
    if "site" not in layers.columns:
        return layers
    sites = list(dict.fromkeys(layers["site"].dropna()))
    if site is None:
        if len(sites) <= 1:
            return layers
        if DEFAULT_SITE not in sites:
            raise ValueError(
                f"the layers table has several sites {sites} and none is the default {DEFAULT_SITE!r}; "
                "pass site= to pick one"
            )
        site = DEFAULT_SITE
    if site not in sites:
        raise ValueError(f"site {site!r} is not in the layers table (sites: {sites})")
    return layers[layers["site"] == site]


__all__ = ["DEFAULT_SITE", "one_site"]
