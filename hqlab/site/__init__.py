"""The project's faces beside the command line: the offline HTML site of the executed notebooks and the docs
(`build`), its check in a headless browser (`check`), the notebooks runner behind `hqlab figures` (`notebooks`)
and the token explorer widget (`explorer`)."""

from hqlab.site.build import SiteError, build_site, external_scripts, site_pages

__all__ = ["SiteError", "build_site", "external_scripts", "site_pages"]
