"""The start-up checks of the run's data, before step 0 (none runs inside a step): enough records for a step and at
least one crop (`check_records`, as soon as the records load), and once the models load, a route for every record
(routed teachers) and every prompt of every view a record is used in within --max-prompt-len (`check_prompts`,
without decoding an image: `prompt_length` of each view's layout, `LAYOUTS`).
"""

from PIL import Image

from opd.cli import UserError
from opd.data.family_views import half_size, reference_prompt
from opd.data.records import Record, views_eligible
from opd.models.chat import encode_prompt, prompt_text


def crop_size(record: Record) -> tuple[int, int]:
    """(width, height) of `opd.data.records.crop_image(record)`: the bbox's, else the crop file's."""
    if record.bbox is not None:
        x1, y1, x2, y2 = record.bbox
        return x2 - x1, y2 - y1
    return record.crop_size


LAYOUTS = {
    "full": lambda r: ([r.image_size], r.problem),
    "crop": lambda r: ([crop_size(r)], r.problem),
    "half_resolution": lambda r: ([half_size(*r.image_size)], r.problem),
    "masked": lambda r: ([crop_size(r)], r.problem),
    "reference_answer": lambda r: ([r.image_size], reference_prompt(r.problem, r.reference)),
}
"""Each view of `opd.data.records.VIEWS` as (image sizes, question) without decoding an image."""


def prompt_length(processor, sizes: list[tuple[int, int]], problem: str, enable_thinking: bool = False) -> int:
    """The token count `encode_prompt` gives for images of these (width, height) sizes, without decoding or
    resizing any image: the templated text's tokens, each image placeholder expanded to the processor's
    number of image tokens for its size (`_get_num_multimodal_tokens`, the count vLLM uses). A processor
    without that method encodes blank images of the sizes instead (slower, the same count)."""
    counter = getattr(processor, "_get_num_multimodal_tokens", None)
    if counter is None or not sizes:
        blanks = [Image.new("RGB", (max(1, w), max(1, h))) for w, h in sizes]
        return len(encode_prompt(processor, blanks, problem, enable_thinking))
    text = prompt_text(processor, problem, len(sizes), enable_thinking)  # one placeholder token per image
    n_text = len(processor.tokenizer(text)["input_ids"])
    per_image = counter(image_sizes=[(max(1, h), max(1, w)) for w, h in sizes])["num_image_tokens"]
    return n_text - len(sizes) + sum(per_image)


def check_records(records: list[Record], views, data_path, prompts_per_step: int, method_name: str) -> None:
    """Refuses data on which the run would do nothing: too few records for a step, or no crop at all (checked as
    soon as the records load, before any model)."""
    n = len(records)
    if n < prompts_per_step:
        raise UserError(f"{data_path}: {n} records cannot fill one step of --prompts-per-step {prompts_per_step}")
    if not any(views_eligible(r, views) for r in records):
        raise UserError(
            f"{data_path}: no record has a crop ('teacher_images' or 'bbox'), which the {method_name} teacher "
            f"views {', '.join(views[1:])} need: every step would train with zero distillation"
        )


def check_prompts(prompts) -> None:
    """Refuses a record without a route (routed teachers), then checks that every record's prompt in every view it is
    used in (the student's, and each teacher view with its teacher's processor) fits --max-prompt-len: one line naming
    the file:line, view and length otherwise. `prompts`: the run's `opd.data.records.Prompts`."""
    if prompts.teachers.routes is not None:
        prompts.teachers.routes.check_records(prompts.records)
    cache: dict[tuple, int] = {}
    limit = prompts.data.max_prompt_len
    for record in prompts.records:
        uses = [(prompts.student_view, prompts.processor)]
        if prompts.eligible(record):
            teacher = prompts.teachers.teachers.get(prompts.teachers.route(record))
            processor = getattr(teacher, "processor", None) or prompts.processor
            uses += [(v, processor) for v in prompts.teacher_views]
        for view, processor in uses:
            sizes, question = LAYOUTS[view](record)
            key = (id(processor), tuple(sizes), question)
            if key not in cache:
                cache[key] = prompt_length(processor, sizes, question, prompts.data.enable_thinking)
            if cache[key] > limit:
                raise UserError(f"{record.source}: its '{view}' prompt has {cache[key]} tokens, over "
                                f"--max-prompt-len {limit} (raise it, or lower the processor's max_pixels)")  # fmt: skip
