/* Search on the site opened from disk. A browser starts no Web Worker from a file:// page, and the theme's search
 * runs in one; here, on file:// only, `Worker` becomes a hidden same-origin iframe that runs the worker's script with
 * the same message interface (postMessage in, "message" events out). Written for this site: the theme's offline
 * plugin would load a shim like it from a CDN, which a site read offline cannot reach (the plugin skips its own when
 * a script named iframe-worker is listed, as this one is in mkdocs.yml). */
(function () {
  "use strict";
  if (location.protocol !== "file:" || typeof EventTarget === "undefined") {
    return;
  }

  class FrameWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.queue = [];
      this.frame = document.createElement("iframe");
      this.frame.hidden = true;
      this.frame.setAttribute("aria-hidden", "true");
      const script = new URL(url, location.href).href;
      this.frame.srcdoc =
        "<!DOCTYPE html><html><head><script>window.postMessage = function (data) { " +
        "window.frameElement.deliver(data); };<\/script>" +
        '<script src="' + script.replace(/"/g, "&quot;") + '"><\/script></head><body></body></html>';
      this.frame.deliver = (data) => {
        const event = new MessageEvent("message", { data: data });
        if (typeof this.onmessage === "function") {
          this.onmessage(event);
        }
        this.dispatchEvent(event);
      };
      this.frame.addEventListener("load", () => {
        const pending = this.queue;
        this.queue = null;
        pending.forEach((data) => this.send(data));
      });
      (document.body || document.documentElement).appendChild(this.frame);
    }

    send(data) {
      const inner = this.frame.contentWindow;
      inner.dispatchEvent(new inner.MessageEvent("message", { data: data }));
    }

    postMessage(data) {
      if (this.queue) {
        this.queue.push(data);
      } else {
        this.send(data);
      }
    }

    terminate() {
      this.frame.remove();
    }
  }

  window.Worker = FrameWorker;
})();
