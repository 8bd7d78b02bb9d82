"""Loaders for a user's own local jsonl files (nothing is downloaded).

- :func:`load_longbench` reads LongBench-format files, ``{task}.jsonl`` (or
  LongBench-E's ``{task}_e.jsonl``), and wraps each record in a short prompt
  in the spirit of LongBench's ``dataset2prompt.json``.
- :func:`load_jsonl` reads any ``{context, question, answers}`` jsonl file.

LongBench truncates over-long prompts in the middle of the context; that
depends on the model's window and is left to the runner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from keepkv.eval.tasks import Sample


class PromptTemplate(NamedTuple):
    """How a LongBench record becomes a :class:`Sample`.

    ``context`` holds ``{context}`` (the instruction goes before it);
    ``question`` may hold ``{input}``; ``answer_prefix`` starts the answer.
    """

    context: str
    question: str
    answer_prefix: str


_MULTI_DOC_QA = PromptTemplate(
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}",
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {input}",
    "Answer:",
)
_CODE = PromptTemplate("Please complete the code given below.\n{context}", "Next line of code:", "")

# Few-shot tasks (trec, triviaqa, samsum, lsht) end with the record's input,
# which is already written in the style of the examples: no answer prefix.
LONGBENCH_TEMPLATES: dict[str, PromptTemplate] = {
    "narrativeqa": PromptTemplate(
        "You are given a story, which can be either a novel or a movie script, and a question. Answer "
        "the question as concisely as you can, using a single phrase if possible.\n\nStory: {context}",
        "Now, answer the question based on the story as concisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}",
        "Answer:",
    ),
    "qasper": PromptTemplate(
        "You are given a scientific article and a question. Answer as concisely as you can. If the article "
        'does not answer the question, write "unanswerable"; answer yes/no questions with "yes", "no" or '
        '"unanswerable".\n\nArticle: {context}',
        "Answer the question based on the above article as concisely as you can. Do not provide any "
        "explanation.\n\nQuestion: {input}",
        "Answer:",
    ),
    "multifieldqa_en": PromptTemplate(
        "Read the following text and answer briefly.\n\n{context}",
        "Now, answer the following question based on the above text, only give me the answer and do not "
        "output any other words.\n\nQuestion: {input}",
        "Answer:",
    ),
    "multifieldqa_zh": PromptTemplate(
        "阅读以下文字并用中文简短回答：\n\n{context}",
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}",
        "回答：",
    ),
    "hotpotqa": _MULTI_DOC_QA,
    "2wikimqa": _MULTI_DOC_QA,
    "musique": _MULTI_DOC_QA,
    "dureader": PromptTemplate(
        "请基于给定的文章回答下述问题。\n\n文章：{context}",
        "请基于上述文章回答下面的问题。\n\n问题：{input}",
        "回答：",
    ),
    "gov_report": PromptTemplate(
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}",
        "Now, write a one-page summary of the report.",
        "Summary:",
    ),
    "qmsum": PromptTemplate(
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}",
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n\n"
        "Query: {input}",
        "Answer:",
    ),
    "multi_news": PromptTemplate(
        "You are given several news passages. Write a one-page summary of all news.\n\nNews:\n{context}",
        "Now, write a one-page summary of all the news.",
        "Summary:",
    ),
    "vcsum": PromptTemplate(
        "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}",
        "请总结上面会议记录的内容。",
        "会议总结：",
    ),
    "trec": PromptTemplate(
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}",
        "{input}",
        "",
    ),
    "triviaqa": PromptTemplate(
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}",
        "{input}",
        "",
    ),
    "samsum": PromptTemplate(
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}",
        "{input}",
        "",
    ),
    "lsht": PromptTemplate("请判断给定新闻的类别，下面是一些例子。\n\n{context}", "{input}", ""),
    "passage_count": PromptTemplate(
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates.\n\n{context}",
        "Please enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.",
        "The final answer is:",
    ),
    "passage_retrieval_en": PromptTemplate(
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n{context}",
        "The following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the "
        'abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.',
        "The answer is:",
    ),
    "passage_retrieval_zh": PromptTemplate(
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}",
        '下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式',
        "答案是：",
    ),
    "lcc": _CODE,
    "repobench-p": PromptTemplate(_CODE.context, "{input}Next line of code:", ""),
}

LONGBENCH_FIELDS = ("context", "input", "answers")
JSONL_FIELDS = ("context", "question", "answers")
DEFAULT_ANSWER_PREFIX = "Answer:"


def _read_jsonl(path: Path, required: tuple[str, ...], limit: int | None) -> list[tuple[int, dict]]:
    """Records of a jsonl file with their 1-based line numbers; blank lines are skipped.

    Raises
    ------
    ValueError
        If the file is missing, a line is not a JSON object, or a required field is absent.
    """
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    records = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: malformed JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}")
            missing = [name for name in required if name not in record]
            if missing:
                raise ValueError(f"{path}:{line_number}: missing field(s) {', '.join(missing)}")
            records.append((line_number, record))
    return records


def _answer_list(value, path: Path, line_number: int) -> list[str]:
    answers = [value] if isinstance(value, str) else value
    if not isinstance(answers, list) or not all(isinstance(answer, str) for answer in answers):
        raise ValueError(f"{path}:{line_number}: answers must be a string or a list of strings")
    return answers


def _task_name(file_stem: str) -> str:
    """LongBench task of a file: ``hotpotqa`` for ``hotpotqa`` and for LongBench-E's ``hotpotqa_e``."""
    if file_stem not in LONGBENCH_TEMPLATES and file_stem.endswith("_e"):
        return file_stem[:-2]
    return file_stem


def load_longbench(directory: str | Path, tasks: list[str] | None = None, limit: int | None = None) -> list[Sample]:
    """Read LongBench jsonl files from a local directory.

    Parameters
    ----------
    directory : str or Path
        Holds ``{task}.jsonl`` files with the fields ``input``, ``context``,
        ``answers`` and optionally ``all_classes``, ``length``, ``dataset``, ``_id``.
    tasks : list of str, optional
        File names without ``.jsonl``; by default every ``*.jsonl`` in ``directory``.
    limit : int, optional
        At most this many samples per task.

    Returns
    -------
    list of Sample
        ``suite`` is ``"longbench"``; ``meta`` holds ``task``,
        ``all_classes`` (a list, empty when absent), ``length`` and ``dataset``.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"no such directory: {directory}")
    file_stems = tasks if tasks is not None else sorted(path.stem for path in directory.glob("*.jsonl"))
    samples = []
    for file_stem in file_stems:
        task = _task_name(file_stem)
        if task not in LONGBENCH_TEMPLATES:
            raise ValueError(f"unknown LongBench task {file_stem!r}; known: {', '.join(LONGBENCH_TEMPLATES)}")
        template = LONGBENCH_TEMPLATES[task]
        path = directory / f"{file_stem}.jsonl"
        for line_number, record in _read_jsonl(path, LONGBENCH_FIELDS, limit):
            samples.append(
                Sample(
                    id=str(record.get("_id", f"{file_stem}-{line_number}")),
                    suite="longbench",
                    context=template.context.format(context=record["context"]),
                    question=template.question.format(input=record["input"]),
                    answer_prefix=template.answer_prefix,
                    answers=_answer_list(record["answers"], path, line_number),
                    meta={
                        "task": task,
                        "all_classes": record.get("all_classes") or [],
                        "length": record.get("length"),
                        "dataset": record.get("dataset", task),
                    },
                )
            )
    return samples


def load_jsonl(path: str | Path, limit: int | None = None) -> list[Sample]:
    """Read a ``{context, question, answers}`` jsonl file.

    ``answers`` is a string or a list of strings. Optional fields: ``id``
    (default ``{file stem}-{line}``) and ``answer_prefix`` (default
    ``"Answer:"``); any other field goes to ``meta``. ``suite`` is the file stem.
    """
    path = Path(path)
    samples = []
    for line_number, record in _read_jsonl(path, JSONL_FIELDS, limit):
        extra = {k: v for k, v in record.items() if k not in JSONL_FIELDS + ("id", "answer_prefix")}
        samples.append(
            Sample(
                id=str(record.get("id", f"{path.stem}-{line_number}")),
                suite=path.stem,
                context=record["context"],
                question=record["question"],
                answer_prefix=record.get("answer_prefix", DEFAULT_ANSWER_PREFIX),
                answers=_answer_list(record["answers"], path, line_number),
                meta=extra,
            )
        )
    return samples
