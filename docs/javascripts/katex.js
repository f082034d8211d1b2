// Renders the math that pymdownx.arithmatex (generic mode) leaves in the page:
// \( … \) in span.arithmatex, \[ … \] (with \tag{…}) in div.arithmatex.
// Material's document$ fires on every page load, instant navigation included.
document$.subscribe(() => {
  for (const element of document.querySelectorAll(".arithmatex")) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  }
});
