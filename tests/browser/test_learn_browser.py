"""The Learn tab in headless Chromium: step one round to its accept stage, then carry it into Generate."""

from __future__ import annotations

from test_playground_browser import ARTIFACTS, page, pytestmark, sync_api  # noqa: F401 (the shared fixture)


def test_learn_steps_to_the_decision_and_opens_in_generate(page):  # noqa: F811
    expect = sync_api.expect
    page.get_by_role("tab", name="Learn").click()
    page.fill("#learn-prompt textarea", "Tell me about owls.")
    page.locator("#learn-method").get_by_label("SpS (lossless)").check()
    page.click("#learn-start")
    explain = page.locator("#learn-explain")
    expect(explain).to_contain_text("stage 1/4: draft", timeout=60_000)
    expect(explain).not_to_contain_text("kept")
    page.click("#learn-step")
    expect(explain).to_contain_text("stage 2/4: verify")
    page.click("#learn-step")
    expect(explain).to_contain_text("stage 3/4: accept / reject")
    expect(explain).to_contain_text("P(accept)")
    expect(page.locator("#learn-divergence")).to_contain_text("Induced divergence so far")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground-learn.png"), full_page=True)
    page.click("#learn-open-generate")
    expect(page.locator("#prompt textarea")).to_have_value("Tell me about owls.")
    expect(page.locator("#method").get_by_label("SpS (lossless)")).to_be_checked()
    expect(page.locator("#generate-btn")).to_be_visible()
