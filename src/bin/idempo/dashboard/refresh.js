// Refreshes the page's main section every 5 s without a full reload; the
// pages work without it (reload by hand).
(function () {
  var main = document.querySelector("main[data-refresh]");
  if (!main || !window.fetch || !window.DOMParser) return;
  setInterval(function () {
    fetch(location.href, { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (!html) return;
        var next = new DOMParser().parseFromString(html, "text/html").querySelector("main");
        if (next) main.innerHTML = next.innerHTML;
      })
      .catch(function () {});
  }, 5000);
})();
