"""Stage 4, time: the accelerator catalog (``hardware``); training time, MFU, the roofline and what fits
(``model``), which read an accounting (typed only: the accounting module sits above and calls them)."""
