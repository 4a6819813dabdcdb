"""The application layer: the ``dtrain`` command line (``cli``), the multi-site launcher
(``launch``), the site process (``worker``) and the run report (``report``)."""
