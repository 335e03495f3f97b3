"""One module per dashboard panel: a pure `*_frame` function that builds the panel's table from
library results (tested directly) and a `render` function that draws it."""
